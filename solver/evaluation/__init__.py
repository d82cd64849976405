"""Evaluation against outside references: the same requests in our simulator, our capacity model and Vidur."""

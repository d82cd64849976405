"""The `coral` command-line tool: one module per command group (`app.py` registers them), the
console helpers every command shares, and the Markdown reports."""

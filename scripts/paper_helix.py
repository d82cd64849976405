"""Old name of `coral bench helix` (its logic: solver/evaluation/paper_helix.py): the paper's Helix
comparison (Sec. 6.6) with coupled and uncoupled decode, as JSON.
Arguments pass through."""

import sys

from coral_iac.cli.app import app

if __name__ == "__main__":
    app(["bench", "helix", *sys.argv[1:]], prog_name="coral")

"""Old name of `coral bench paper` (its logic: solver/evaluation/paper_comparison.py): the paper's
ratios beside ours, every Sec. 6 scenario in the paper's setup and ours.
Arguments pass through."""

import sys

from coral_iac.cli.app import app

if __name__ == "__main__":
    app(["bench", "paper", *sys.argv[1:]], prog_name="coral")

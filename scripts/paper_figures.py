"""Old name of `coral bench figures` (its logic: solver/evaluation/paper_figures.py): the paper's
Fig. 1a and Fig. 1b on our performance model, as PNGs and numbers.json.
Arguments pass through."""

import sys

from coral_iac.cli.app import app

if __name__ == "__main__":
    app(["bench", "figures", *sys.argv[1:]], prog_name="coral")

"""Old name of `coral bench fig1a` (its logic: solver/evaluation/paper_figures.py): Fig. 1a for one
(model, phase) of a stack, best mixed vs best single-type template, as JSON.
Arguments pass through."""

import sys

from coral_iac.cli.app import app

if __name__ == "__main__":
    app(["bench", "fig1a", *sys.argv[1:]], prog_name="coral")

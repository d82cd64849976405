"""The `coral` command-line tool: one module per command group (`app.py` registers them).
Takes command lines; gives every stage's output, for people (stderr) and as `--json` (stdout).

`console.py` holds the helpers every command shares, `reports.py` the Markdown reports.
"""

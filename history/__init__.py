"""Performance history: every run and gate recorded, change points found, the culprit bisected.

- `store` / `schema`: the results store (SQLite by default, any SQLAlchemy URL), versioned
  schema with migrations, one transaction per record.
- `ingest`: a run folder or a gate.json, with the commit and the machine, as a `Record`.
- `changes`: change points per metric and per machine fingerprint (ruptures' kernel change
  point search, a permutation test for significance, a bootstrap interval for the magnitude).
- `report` / `summary`: the HTML history report; the Markdown summary for CI.
- `run_link`: a recorded run folder's own history page, linked from its run report.
- `bisect`: `git bisect` driven by the paired gate.

The engine never imports this package; it imports only the workbench's helpers.
"""

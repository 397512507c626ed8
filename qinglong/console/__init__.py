"""The operator's console around the Django admin (README "The operator's console").

- `selectors`: the bounded reads behind the overview page and the `/metrics`
  gauges (a fixed number of queries whatever the number of Runs);
- `charts`: server-rendered SVG bar charts (plain Python, no JavaScript);
- `views`: the overview page (an admin view) and `/metrics`;
- `site`: the project's AdminSite (the overview URL, the index linking it).

An entry point (docs/adr/0004 layers): it reads every app, nothing imports it.
"""

"""The serving node's HTTP routes, one module per concern: ``predict``, ``models`` (status and
the admin calls reload and rollback), ``health`` (liveness, readiness, metrics) and
``errors`` (every error answered as JSON). serving/http/app.py puts them together."""

"""Model access: which model scores a request (``routing``, ``experiments``), the callers'
quotas and priorities (``quotas``) and the prediction log (``prediction_log``)."""

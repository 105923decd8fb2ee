"""streamrec: streaming online learning for large sparse recommendation (CTR) models.

Packages, from the bottom layer up (docs/architecture.md; import-linter enforces the order):
``contracts`` (event, sample, feature-state and model-version formats), ``plumbing``
(configuration, Kafka), ``embedding`` (the tiered embedding store) beside ``modelstore``
(published versions), ``model`` (the CTR model trainer and serving share), then the four
runtime parts ``pipelines`` (the Flink job), ``generator`` (synthetic traffic), ``trainer``
and ``serving``, and on top ``demo`` and ``cli`` (the one ``streamrec`` command).
"""

__version__ = "0.1.0"

"""Message-bus plumbing shared by every part: Kafka clients, topic admin, and the
embedded broker for laptops, tests and CI. Nothing here assumes the embedded broker:
every function takes a bootstrap address, which may point at any Kafka cluster."""

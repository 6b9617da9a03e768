"""The cascade at runtime: the router that scores `model: auto`, the classifier
registry, the learner that shadows requests for labels, and the label store."""

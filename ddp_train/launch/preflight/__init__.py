"""The checks before anything starts: every node's facts, GPU health, the training interface, RDMA."""

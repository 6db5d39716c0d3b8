"""Tensor parallelism: process groups, weight sharding, collectives, and direct peer sockets."""

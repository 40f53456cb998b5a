"""The training loop and its policies: data, logging, checkpoint policy, preflight checks, exits."""

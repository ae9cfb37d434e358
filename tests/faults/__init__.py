"""Fault injection, bit-flip detection and API fuzzing: the store under failure and hostile use."""

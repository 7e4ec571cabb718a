"""Speculative decoding on the scheduler's side: drafters propose, one step verifies."""

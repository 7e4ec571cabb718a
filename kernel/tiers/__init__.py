"""The host and storage tiers as the scheduler sees them: loads, writes, their policies."""

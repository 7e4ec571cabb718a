"""Hybrid models' recurrent-state slots as the scheduler sees them, and the strategy ABC."""

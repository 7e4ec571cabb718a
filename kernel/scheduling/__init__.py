"""How a step is planned and run: the scheduler, chunk planning, prefix reuse, the step loop, overlap."""

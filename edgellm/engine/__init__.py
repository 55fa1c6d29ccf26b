"""The engine: sequences, the paged block manager, the scheduler, the step, stop rules, outputs."""

"""Generate: sampling, sequences, the scheduler and engine, chat templates, constraints."""

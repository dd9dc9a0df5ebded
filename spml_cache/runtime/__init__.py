"""What every stage needs from the process it runs in: devices, memory, progress, locks, child processes,
torchrun's ranks and the errors a user reads. Imports nothing itself, so that each module loads only what it
uses."""

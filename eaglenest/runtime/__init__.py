"""Where the code runs: processes and signals, errors and exits, servers in their own environments,
torchrun, the machine and its compute dtype, versions, wheels."""

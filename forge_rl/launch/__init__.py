"""Launching a run: where its hosts come from (local, or a Slurm allocation through Monarch's job API), stopping
before a job's time limit, submitting a whole run as one sbatch job, and the signal handling that makes a run
in the background stop as one in a terminal does."""

"""The Slurm backend of ddp-launch (`--backend slurm`, or `ddp_backend: slurm` in the inventory).

settings.py: the sbatch options from flags and inventory; submit.py: preflight, the batch script and
`sbatch --parsable` over SSH on the slurm_login/slurm_controller host, then following the job;
driver.py: the batch script's Python driver on node 0, over recovery.py (the attempts across requeues
and node losses) and task.py (the program srun starts on every node); protocol.py: the log files and
lines the driver writes and submit.py reads; jobctl.py: state (squeue, then scontrol), logs and stop for
`ddp-launch status/logs/stop JOB`.
"""

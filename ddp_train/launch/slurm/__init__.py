"""The Slurm backend of ddp-launch (`--backend slurm`, or `ddp_backend: slurm` in the inventory).

settings.py: the sbatch options from flags and inventory; submit.py: preflight, the batch script and
`sbatch --parsable` over SSH on the slurm_login/slurm_controller host, then following the job;
driver.py: the batch script's Python driver on node 0 and the per-node program srun starts;
jobctl.py: state (squeue, then scontrol), logs and stop for `ddp-launch status/logs/stop JOB`.
"""

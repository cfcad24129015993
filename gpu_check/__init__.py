"""The one GPU check (`make gpu-check`, `python -m gpu_check`): check.py runs it, probes.py holds the two parts that
touch CUDA from Python, offline.py builds the offline form's folder, verl_stage.py the verl stage. docs/gpu-check.md."""

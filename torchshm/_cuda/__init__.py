"""The CUDA seam (Note [The CUDA seam] in runtime.py): the only place
torchshm calls CUDA, and a fake runtime that keeps CUDA's rules on a CPU
(fake.py), for the tests and the device script's CPU half."""

"""`python -m dstrain ...` and `torchrun --nproc-per-node N -m dstrain train RECIPE ...`."""

from dstrain.cli import main

if __name__ == "__main__":
    main()

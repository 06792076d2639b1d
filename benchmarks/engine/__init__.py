"""The engine and its kernels in one process: where a step's time goes, each lever side by side, against the
libraries and the memory-bandwidth floor."""

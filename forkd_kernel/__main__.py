"""``python -m forkd_kernel -f {connection_file}``: the kernelspec's command."""

from ipykernel.kernelapp import IPKernelApp

from .kernel import ForkdKernel

if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=ForkdKernel)

# Sourced by the GPU scripts: NVLink multicast off, and NCCL/cuBLAS from the PyTorch
# environment's nvidia packages when the machine has no system copies of this major version.
export NCCL_NVLS_ENABLE=0
for pkg in nccl cublas; do
  dir=$(python3 -c "import nvidia.$pkg as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
  [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
true  # sourcing succeeds when a package is missing, so `source gpu_env.sh && cmd` runs cmd

# Sourced by the GPU runner (scripts/gpu.sh) and bench/sanitize_gpu.sh: NVLink multicast off,
# NCCL/cuBLAS from the PyTorch environment's nvidia packages when the machine has no system
# copies of this major version, and a private MPS daemon.
export NCCL_NVLS_ENABLE=0
for pkg in nccl cublas; do
  dir=$(python3 -c "import nvidia.$pkg as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null)
  [ -n "$dir" ] && export LD_LIBRARY_PATH="$dir:${LD_LIBRARY_PATH:-}"
done
# An MPS control daemon of the calling script's own (private pipe and log folders; stopped and
# removed by mps_daemon_stop). Returns 1 where MPS is off (MPS=0) or unavailable.
mps_daemon_start() {
  [[ ${MPS:-auto} != 0 ]] && command -v nvidia-cuda-mps-control >/dev/null || return 1
  export CUDA_MPS_PIPE_DIRECTORY=$(mktemp -d /tmp/moka-mps-pipe.XXXXXX) CUDA_MPS_LOG_DIRECTORY=$(mktemp -d /tmp/moka-mps-log.XXXXXX)
  nvidia-cuda-mps-control -d && return 0
  mps_daemon_stop
  return 1
}
mps_daemon_stop() {
  echo quit | nvidia-cuda-mps-control 2>/dev/null
  rm -rf "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
true  # sourcing succeeds when a package is missing, so `source gpu_env.sh && cmd` runs cmd

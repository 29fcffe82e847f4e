# The kvstore daemon on a CUDA runtime. Run it beside the workers that use it:
#   docker run --gpus all --ipc=host -v /tmp/kvstore:/run/kvstore kvstore
# (--ipc=host: CUDA IPC and /dev/shm buffers need the host's IPC namespace.)
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvstore
ENV PATH=/opt/kvstore/bin:$PATH
WORKDIR /app
COPY requirements.txt pyproject.toml ./
RUN pip install --no-cache-dir torch triton==3.6.0 "numpy<2.4" "grpcio==1.84.0" "grpcio-health-checking==1.84.0" \
    "grpcio-reflection==1.84.0" "protobuf>=7.35,<8" safetensors faiss-cpu lmdb prometheus-client
COPY protos protos
COPY kvstore kvstore
COPY kernels kernels
COPY client client
COPY server.py ./
RUN pip install --no-cache-dir --no-deps --no-build-isolation .

RUN useradd --system --uid 10001 kvstore && mkdir -p /run/kvstore && chown kvstore /run/kvstore
USER kvstore
ENV KVSTORE_SOCKET=/run/kvstore/kvstore.sock PYTORCH_CUDA_ALLOC_CONF=""
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s \
    CMD python3 -c "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
ch=grpc.insecure_channel('unix:///run/kvstore/kvstore.sock'); \
sys.exit(0 if g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=3).status==1 else 1)"
ENTRYPOINT ["kvstore-server"]
CMD ["--socket", "/run/kvstore/kvstore.sock"]

# The kvstore daemon on a CUDA runtime. Run it beside the workers that use it
# (README: "Running in containers"):
#   install -d -m 0700 -o 10001 /tmp/kvstore
#   docker run --gpus '"device=0"' --ipc=host -v /tmp/kvstore:/run/kvstore -p 127.0.0.1:9400:9400 kvstore
# --ipc=host: CUDA IPC and /dev/shm buffers need the host's IPC namespace.
# Workers run as uid 10001 too (the socket is 0600), on the same GPU.
FROM nvidia/cuda:13.0.0-runtime-ubuntu24.04

RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/kvstore
ENV PATH=/opt/kvstore/bin:$PATH
WORKDIR /app
# The pins `make install` uses (requirements.txt: one list, no copy here), then cupy
# for the CUDA C++ kernels under the same pins. torch==2.13.0 from PyPI is its CUDA
# build; cupy-cuda13x compiles the kernels with the NVRTC of this CUDA 13 runtime image.
COPY requirements.txt requirements-cuda.txt ./
RUN pip install --no-cache-dir -r requirements.txt \
    && pip install --no-cache-dir -c requirements.txt -r requirements-cuda.txt
COPY pyproject.toml ./
COPY protos protos
COPY kvstore kvstore
COPY kernels kernels
COPY client client
COPY server.py ./
# A wheel of kvstore (setuptools from requirements.txt): package-data puts the CUDA C++
# sources (kernels/cuda/*.cu, *.cuh) into it; the last step fails the build if the
# installed package cannot find them, so an image never ships without its kernels.
RUN pip install --no-cache-dir --no-deps --no-build-isolation . \
    && cd / && python3 -c "from kvstore.kernels.cuda import build; [build.source(f) for f in ('attention.cu', 'merge.cu', 'encode.cu')]" \
    && rm -rf /app
WORKDIR /

# /var/lib/kvstore: the disk tier's volume (README); a fresh named volume takes this ownership
RUN useradd --system --uid 10001 kvstore && install -d -m 0700 -o kvstore /run/kvstore /var/lib/kvstore
USER kvstore
# expandable_segments breaks CUDA IPC: never let a base image or -e turn it on.
ENV KVSTORE_SOCKET=/run/kvstore/kvstore.sock PYTORCH_CUDA_ALLOC_CONF=""
# The gRPC health service over the socket; no torch import, so it answers in well under the timeout.
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s \
    CMD python3 -c "import grpc,os,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; \
ch=grpc.insecure_channel('unix://'+os.environ['KVSTORE_SOCKET']); \
sys.exit(0 if g.HealthStub(ch).Check(h.HealthCheckRequest(), timeout=3).status==h.HealthCheckResponse.SERVING else 1)"
EXPOSE 9400
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvstore-server"]
# Metrics bind all interfaces inside the container; publish the port to 127.0.0.1 (above) or a scrape network.
CMD ["--socket", "/run/kvstore/kvstore.sock", "--metrics-port", "9400", "--metrics-host", "0.0.0.0"]

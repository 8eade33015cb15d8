#!/usr/bin/env bash
# Entrypoint of the finetune cloud image (docker/Dockerfile.cloud): start the optional services
# (sshd, JupyterLab) that the image was built with, then run the command (default: sleep infinity).
#
# Runs as the unprivileged `finetune` user by default. Started with `--user root`, it does only the
# parts that need root (own the mounted /workspace, sshd on any port / for root), then drops to
# `finetune` for everything else.
#
# Run-time settings (environment; none are stored in the image):
#   PUBLIC_KEY      an SSH public key to authorize (RunPod and others set this); sshd starts only if a
#                   key is available (PUBLIC_KEY or an existing ~/.ssh/authorized_keys)
#   SSH_PORT        default 2222 (non-root sshd cannot bind ports below 1024)
#   JUPYTER_ENABLE  0 to not start JupyterLab even though it is installed
#   JUPYTER_PORT    default 8888
#   JUPYTER_TOKEN   read by Jupyter itself; when unset Jupyter makes a random one and logs the URL
set -euo pipefail

RUN_USER=finetune
RUN_HOME=/home/${RUN_USER}
SSH_PORT=${SSH_PORT:-2222}
HF_HOME=${HF_HOME:-/workspace/.cache/huggingface}

log() { echo "[finetune-cloud] $*" >&2; }

# Writes the authorized key for one user ($2: "uid:gid"); returns 1 when that user has no key at all.
install_key() {
    local home=$1 owner=$2
    mkdir -p "${home}/.ssh"
    chmod 700 "${home}/.ssh"
    if [[ -n "${PUBLIC_KEY:-}" ]] && ! grep -qxF "${PUBLIC_KEY}" "${home}/.ssh/authorized_keys" 2> /dev/null; then
        echo "${PUBLIC_KEY}" >> "${home}/.ssh/authorized_keys"
    fi
    [[ -s "${home}/.ssh/authorized_keys" ]] || return 1
    chmod 600 "${home}/.ssh/authorized_keys"
    chown -R "${owner}" "${home}/.ssh"
}

# $1: directory for host keys, config and pid file; $2: extra sshd_config lines.
start_sshd() {
    local dir=$1 extra=$2
    mkdir -p "${dir}"
    [[ -f "${dir}/ssh_host_ed25519_key" ]] || ssh-keygen -q -t ed25519 -N '' -f "${dir}/ssh_host_ed25519_key"
    cat > "${dir}/sshd_config" << EOF
Port ${SSH_PORT}
HostKey ${dir}/ssh_host_ed25519_key
PidFile ${dir}/sshd.pid
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
X11Forwarding no
Subsystem sftp internal-sftp
${extra}
EOF
    /usr/sbin/sshd -f "${dir}/sshd_config"
    log "sshd listening on port ${SSH_PORT}"
}

if [[ "$(id -u)" == 0 ]]; then
    # Providers often mount /workspace root-owned. Not recursive: a network volume with a model cache
    # can hold millions of files, and what finetune writes goes into these directories.
    mkdir -p /workspace/outputs /workspace/.cache "${HF_HOME}"
    chown "${RUN_USER}:${RUN_USER}" /workspace /workspace/outputs /workspace/.cache "${HF_HOME}"
    if [[ -x /usr/sbin/sshd && -z "${FINETUNE_SSHD_STARTED:-}" ]]; then
        if install_key "${RUN_HOME}" "${RUN_USER}:${RUN_USER}"; then
            install_key /root 0:0 || true
            start_sshd /etc/ssh/finetune "PermitRootLogin prohibit-password"
            export FINETUNE_SSHD_STARTED=1
        else
            log "sshd not started: set PUBLIC_KEY to an SSH public key"
        fi
    fi
    exec setpriv --reuid="${RUN_USER}" --regid="${RUN_USER}" --init-groups "$0" "$@"
fi

if [[ ! -w /workspace ]]; then
    log "/workspace is not writable by uid $(id -u); chown the volume or start once with --user root"
fi

if [[ -x /usr/sbin/sshd && -z "${FINETUNE_SSHD_STARTED:-}" ]]; then
    if install_key "${HOME}" "$(id -u):$(id -g)"; then
        # Unprivileged sshd: no PAM (needs root) and logins only as this same user.
        start_sshd "${HOME}/.ssh/sshd" "UsePAM no"
    else
        log "sshd not started: set PUBLIC_KEY to an SSH public key"
    fi
fi

if command -v jupyter > /dev/null && [[ "${JUPYTER_ENABLE:-1}" != 0 ]]; then
    jupyter lab --no-browser --ip=0.0.0.0 --port="${JUPYTER_PORT:-8888}" --ServerApp.root_dir=/workspace &
    log "JupyterLab starting on port ${JUPYTER_PORT:-8888}"
fi

exec "$@"

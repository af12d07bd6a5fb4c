#!/usr/bin/env bash
# Installs NGINX and its NJS module (Debian's nginx and libnginx-mod-http-js),
# which the NGINX Gateway Fabric tests run (internal/ngfshim/nginx,
# test/e2e/nginx_test.go). Does nothing when both are there already: the
# nginx binary ($TALLY_NGINX, else nginx on PATH, else /usr/sbin/nginx) and
# the module ($TALLY_NGINX_JS_MODULE, else Debian's path). Installing needs
# apt-get and root (or sudo); elsewhere it says what to install and fails,
# unless TALLY_NGINX_OPTIONAL=1 lets the tests that need NGINX skip.
#
# The tests run their own NGINX from a temporary directory; the install
# must not start the distribution's service, so it runs with invoke-rc.d
# told not to start services (a policy-rc.d), unless one is in place.
set -euo pipefail

module="${TALLY_NGINX_JS_MODULE:-/usr/lib/nginx/modules/ngx_http_js_module.so}"
bin="${TALLY_NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}"

if [[ -x "${bin}" && -f "${module}" ]]; then
  exit 0
fi

log() { echo "nginx.sh: $*" >&2; }
can_install=yes
if ! command -v apt-get >/dev/null; then
  can_install=no
elif [[ "$(id -u)" != 0 ]] && ! command -v sudo >/dev/null; then
  can_install=no
fi
if [[ "${TALLY_NGINX_OPTIONAL:-}" == 1 && "${can_install}" == no ]]; then
  log "nginx (${bin}) or its NJS module (${module}) is missing; TALLY_NGINX_OPTIONAL=1: the tests that need them skip"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  log "nginx (${bin}) or its NJS module (${module}) is missing and there is no apt-get:"
  log "install nginx with the NJS module (ngx_http_js_module), then set TALLY_NGINX and TALLY_NGINX_JS_MODULE"
  log "to their paths, or set TALLY_NGINX_OPTIONAL=1 to skip the tests that need them"
  exit 1
fi
sudo=()
if [[ "$(id -u)" != 0 ]]; then
  if ! command -v sudo >/dev/null; then
    log "installing nginx and libnginx-mod-http-js needs root: run this as root, or install them yourself"
    exit 1
  fi
  sudo=(sudo)
fi

policy=/usr/sbin/policy-rc.d
if [[ ! -e "${policy}" ]]; then
  "${sudo[@]}" sh -c "printf '#!/bin/sh\nexit 101\n' > ${policy} && chmod 755 ${policy}"
  trap '"${sudo[@]}" rm -f "${policy}"' EXIT
fi
log "installing nginx and libnginx-mod-http-js with apt-get"
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nginx libnginx-mod-http-js >/dev/null

bin="${TALLY_NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}"
if [[ ! -x "${bin}" || ! -f "${module}" ]]; then
  log "installed, but ${bin} or ${module} is still missing"
  exit 1
fi
log "$("${bin}" -v 2>&1), NJS module ${module}"

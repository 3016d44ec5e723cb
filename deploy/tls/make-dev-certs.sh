#!/usr/bin/env bash
# A development CA with a server and a client certificate, for TLS on the public port:
#
#   deploy/tls/make-dev-certs.sh [DIR]        # default DIR: deploy/tls/dev (git-ignored)
#
# Writes DIR/ca.pem (+ ca-key.pem), DIR/server.pem + server-key.pem (for inference-svc
# --tls-cert-file/--tls-key-file) and DIR/client.pem + client-key.pem (mutual TLS clients).
# The server certificate names localhost, 127.0.0.1 and the in-cluster / compose names;
# add more with TLS_SANS="DNS:svc.example.com,IP:10.0.0.7". Keys are left readable by
# other users so that a container's non-root user can read a bind-mounted secret: these are
# development certificates. In production, use your own CA (e.g. cert-manager) instead.
set -euo pipefail
DIR=${1:-"$(dirname "$0")/dev"}
DAYS=${TLS_DAYS:-30}
SANS="DNS:localhost,IP:127.0.0.1,DNS:inference,DNS:inference-svc"
SANS+=",DNS:inference-svc.default.svc,DNS:inference-svc.default.svc.cluster.local"
[ -n "${TLS_SANS:-}" ] && SANS+=",$TLS_SANS"
mkdir -p "$DIR"
cd "$DIR"
ssl() { openssl "$@" 2>/dev/null; }

ssl req -x509 -newkey rsa:2048 -nodes -days "$DAYS" -subj "/CN=inference-svc dev CA" \
    -keyout ca-key.pem -out ca.pem
printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$SANS" >server.ext
printf 'extendedKeyUsage=clientAuth\n' >client.ext
for name in server client; do
    ssl req -newkey rsa:2048 -nodes -subj "/CN=inference-svc $name" \
        -keyout "$name-key.pem" -out "$name.csr"
    ssl x509 -req -in "$name.csr" -CA ca.pem -CAkey ca-key.pem -CAcreateserial \
        -days "$DAYS" -extfile "$name.ext" -out "$name.pem"
    rm -f "$name.csr" "$name.ext"
done
chmod 644 ./*.pem
chmod 600 ca-key.pem
echo "TLS files in $DIR: ca.pem, server.pem, server-key.pem, client.pem, client-key.pem" >&2

#!/usr/bin/env bash
# System packages the tests need: GStreamer's RTSP server, driven from Debian's python3 by
# tests/support/rtsp_server.py (the RTSP reconnection tests), and the mosquitto MQTT broker
# (with mosquitto_passwd) plus openssl for its TLS certificates, run by
# tests/support/mosquitto.py (the MQTT tests). Installing mosquitto may start Debian's own
# broker service on port 1883 where a service manager runs: harmless, the tests start their
# own brokers on free loopback ports. Idempotent; needs root or sudo.
set -e
PACKAGES=(
    python3-gi
    gir1.2-gst-rtsp-server-1.0
    python3-gst-1.0
    gstreamer1.0-plugins-base
    gstreamer1.0-plugins-good
    gstreamer1.0-plugins-bad
    gstreamer1.0-plugins-ugly
    mosquitto
    openssl
    libgl1
    chromium
)
installed=$(dpkg-query -W -f='${Status}\n' "${PACKAGES[@]}" 2>/dev/null | grep -c 'install ok installed' || true)
if [ "$installed" -eq "${#PACKAGES[@]}" ]; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null

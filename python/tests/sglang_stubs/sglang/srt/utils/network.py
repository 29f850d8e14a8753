# SPDX-License-Identifier: Apache-2.0
"""Stub of sglang.srt.utils.network with the same semantics for what the
disaggregation code uses."""
import ipaddress
import os
import socket


class NetworkAddress:
    def __init__(self, host, port=None):
        self.host = str(host).strip("[]")
        self.port = None if port is None else int(port)

    @property
    def is_ipv6(self):
        try:
            return ipaddress.ip_address(self.host).version == 6
        except ValueError:
            return False

    def _h(self):
        return f"[{self.host}]" if self.is_ipv6 else self.host

    def to_tcp(self):
        return f"tcp://{self._h()}:{self.port}"

    def to_url(self):
        return f"http://{self._h()}:{self.port}"

    def to_host_port_str(self):
        return f"{self._h()}:{self.port}"

    def resolved(self):
        try:
            return NetworkAddress(socket.gethostbyname(self.host), self.port)
        except OSError:
            return self

    @classmethod
    def parse(cls, s):
        s = str(s)
        if s.startswith("["):
            host, _, rest = s[1:].partition("]")
            return cls(host, rest.lstrip(":") or None)
        host, _, port = s.rpartition(":")
        return cls(host, port) if host else cls(s)

    def __str__(self):
        return f"{self._h()}:{self.port}"


def get_local_ip_auto(fallback=None):
    return os.environ.get("SGLANG_HOST_IP") or fallback or "127.0.0.1"


def get_zmq_socket_on_host(context, socket_type, host=None):
    sock = context.socket(socket_type)
    na = NetworkAddress(host or "127.0.0.1")
    if na.is_ipv6:
        import zmq

        sock.setsockopt(zmq.IPV6, 1)
    port = sock.bind_to_random_port(f"tcp://{na._h()}")
    return port, sock

"""Certificates made at test time with openssl, for the TLS tests (server, clients, collector)."""
import subprocess


def openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def make_pki(d):
    """Two CAs; a server certificate for 127.0.0.1/localhost and three client certificates."""
    for ca in ("ca", "other_ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN=attnserve test {ca}",
                "-keyout", f"{d}/{ca}.key", "-out", f"{d}/{ca}.pem")
    ext = f"{d}/server.ext"
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, ca, extra in (("server", "ca", ["-extfile", ext]), ("client", "ca", []), ("admin", "ca", []),
                            ("stranger", "other_ca", [])):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{d}/{name}.key",
                "-out", f"{d}/{name}.csr")
        openssl("x509", "-req", "-in", f"{d}/{name}.csr", "-CA", f"{d}/{ca}.pem", "-CAkey", f"{d}/{ca}.key",
                "-CAcreateserial", "-days", "2", "-out", f"{d}/{name}.pem", *extra)

"""1,000 idle connections to a Publisher's metrics endpoint: threads before, during, and a scrape's answer."""
import socket, threading, time, urllib.request
from wsync.metrics import PublisherMetrics
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
m = PublisherMetrics(port)
base = threading.active_count()
conns = [socket.create_connection(("127.0.0.1", port)) for _ in range(1000)]
time.sleep(1.0)
peak = threading.active_count()
t0 = time.perf_counter()
body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
print(f"threads: {base} before, {peak} with 1000 idle connections; scrape {len(body)} bytes in "
      f"{(time.perf_counter()-t0)*1e3:.1f} ms")
for c in conns: c.close()
m.close()

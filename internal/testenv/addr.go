package testenv

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
)

// FreeAddr returns a loopback address whose port is free now and outside the kernel's
// ephemeral port range. Tests restart servers on the same address (crash and restart
// tests); a port the kernel handed out with :0 comes from that range, and while the
// server is down any process's outgoing connection may take it as its local port, so
// the restart fails with "address already in use" (TestChaos did, once). Ports below
// the range are never given to outgoing connections. Test processes running side by
// side pick at random among more than 20,000 ports, and each pick is checked by
// listening on it.
func FreeAddr(t testing.TB) string {
	t.Helper()
	lo, hi := freePortRange()
	for range 200 {
		port := lo + rand.IntN(hi-lo+1)
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err != nil {
			continue
		}
		addr := ln.Addr().String()
		ln.Close()
		return addr
	}
	t.Fatalf("no free port in %d-%d", lo, hi)
	return ""
}

// freePortRange is where FreeAddr picks: below the ephemeral range
// (/proc/sys/net/ipv4/ip_local_port_range, 32768–60999 by default) and above the
// well-known and most registered service ports, or above it when it starts too low.
func freePortRange() (lo, hi int) {
	eLo, eHi := 32768, 60999
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			a, errA := strconv.Atoi(f[0])
			z, errZ := strconv.Atoi(f[1])
			if errA == nil && errZ == nil && a <= z {
				eLo, eHi = a, z
			}
		}
	}
	if eLo-1 >= 12000+5000 {
		return 12000, eLo - 1
	}
	return eHi + 1, 65535
}

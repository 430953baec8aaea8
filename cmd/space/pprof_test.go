package main

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"testing"
	"time"
)

// TestPprofLoopbackOnly: the profiling endpoint refuses a non-loopback address and
// serves the index on a loopback one until its context ends.
func TestPprofLoopbackOnly(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, bad := range []string{"0.0.0.0:0", ":0", "192.0.2.1:6060", "nohost"} {
		if err := startPprof(ctx, bad, log); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
	if err := startPprof(ctx, "", log); err != nil {
		t.Fatalf("unset: %v", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	if err := startPprof(ctx, addr, log); err != nil {
		t.Fatal(err)
	}
	c := &http.Client{Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/debug/pprof/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("index: %s", resp.Status)
	}
}

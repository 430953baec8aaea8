package agentclient

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
)

// A reply that is not the agent's protocol (a status the call does not expect, an
// oversized body) is the gateway's fault: 502, never a 500 of space's own.
func TestRepliesOutsideTheProtocolAreBadGateway(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/v1/files/mkdir": // 200 where 201 is expected
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"name":"x"}`))
		case "/v1/files/stat": // larger than MaxSmallReply
			_, _ = w.Write([]byte(`{"name":"` + strings.Repeat("x", MaxSmallReply) + `"}`))
		default:
			http.Error(w, `{"code":"not_found","message":"no such file"}`, http.StatusNotFound)
		}
	}))
	defer srv.Close()
	c := NewVia(srv.URL, http.DefaultTransport, nil)
	ctx := context.Background()
	if _, err := c.Mkdir(ctx, wire.MkdirRequest{Path: "/tmp/x"}); fault.KindOf(err) != fault.BadGateway {
		t.Errorf("mkdir answered 200: %v (kind %v), want bad gateway", err, fault.KindOf(err))
	}
	if _, err := c.Stat(ctx, "/etc/hostname", ""); fault.KindOf(err) != fault.BadGateway {
		t.Errorf("oversized stat: %v (kind %v), want bad gateway", err, fault.KindOf(err))
	}
	if _, err := c.List(ctx, "/nope", "", 1); fault.KindOf(err) != fault.NotFound || !strings.Contains(err.Error(), "no such file") {
		t.Errorf("agent 404: %v (kind %v), want not found with the agent's words", err, fault.KindOf(err))
	}
}

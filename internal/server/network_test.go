package server_test

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/node"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
)

// netSpace is a space whose node has a fake network manager.
func netSpace(t *testing.T, svc func(*service.Config)) (*spacetest.Space, *spacetest.FakeNetwork) {
	fn := spacetest.NewFakeNetwork()
	s := spacetest.Start(t, spacetest.Options{
		Node:    func(c *node.Config) { c.Network = fn },
		Service: svc,
	})
	return s, fn
}

// TestNetworkBadInput: invalid CIDRs, domains, ports and proxy addresses are 400s that
// name the field, and create nothing.
func TestNetworkBadInput(t *testing.T) {
	s, _ := netSpace(t, nil)
	for _, tc := range []struct{ body, want string }{
		{`{"network":{"egress":true,"allow_out":["10.0.0.0/33"]}}`, `network.allow_out[0]: invalid CIDR \"10.0.0.0/33\"`},
		{`{"network":{"egress":true,"allow_out":["ok.example.com","bad_domain!.com"]}}`, `network.allow_out[1]`},
		{`{"network":{"egress":true,"deny_out":["10.0.0.1/8"]}}`, `network.deny_out[0]: invalid CIDR \"10.0.0.1/8\": host bits set`},
		{`{"network":{"egress":true,"allow_out":["169.254.169.254"]}}`, `network.allow_out[0]: 169.254.169.254 is in an always-denied range`},
		{`{"network":{"egress":true,"egress_proxy":{"address":"proxy.example.com:0"}}}`, `network.egress_proxy.address`},
		{`{"network":{"egress":true,"egress_proxy":{"address":"proxy.example.com"}}}`, `network.egress_proxy.address`},
		{`{"network":{"egress":true,"egress_proxy":{"address":"proxy.example.com:99999"}}}`, `network.egress_proxy.address`},
		{`{"network":{"allow_out":["example.com"]}}`, `network.allow_out: needs egress on`},
		{`{"network":{"egress":true,"rules":{"b.example.com":[{"transform":{"headers":{"Authorization":"x"}}}]},"deny_out":["0.0.0.0/0"]}}`, `network.rules[b.example.com]`},
		{`{"network":{"egress":true,"rules":{"a.example.com":[{"transform":{"headers":{"Host":"x"}}}]}}}`, `network.rules[a.example.com]`},
		{`{"network":{"egress":"yes"}}`, `network.egress`},
	} {
		code, body := do(t, s, "POST", "/v1/sandboxes", tc.body)
		if code != http.StatusBadRequest || !strings.Contains(body, tc.want) {
			t.Errorf("create %s: %d %s, want 400 naming %q", tc.body, code, body, tc.want)
		}
	}
	list, err := s.C.ListSandboxes(ctx(t), client.ListOptions{})
	if err != nil || len(list) != 0 {
		t.Fatalf("invalid creates made sandboxes: %v %v", list, err)
	}

	sb := s.Create(api.CreateSandboxRequest{Network: &api.Network{Egress: true}})
	for _, tc := range []struct{ method, body, want string }{
		{"PATCH", `{"allow_out":["300.1.2.3"]}`, `network.allow_out[0]: invalid address`},
		{"PATCH", `{"deny_out":"0.0.0.0/0"}`, `network.deny_out must be`},
		{"PATCH", `{"egress_proxy":{"address":"[::1]:1080"}}`, `network.egress_proxy.address`},
		{"PATCH", `{"nope":true}`, `unknown field`},
		{"PATCH", `[]`, `must be a JSON object`},
		{"PUT", `{"egress":true,"allow_out":["*"]}`, `network.allow_out[0]`},
		{"PATCH", ``, `request body is empty`},
	} {
		code, body := do(t, s, tc.method, "/v1/sandboxes/"+sb.ID+"/network", tc.body)
		if code != http.StatusBadRequest || !strings.Contains(body, tc.want) {
			t.Errorf("%s %s: %d %s, want 400 naming %q", tc.method, tc.body, code, body, tc.want)
		}
	}
	st, err := s.C.GetNetwork(ctx(t), sb.ID)
	if err != nil || !st.Network.Egress || len(st.Network.AllowOut) != 0 || !st.Applied {
		t.Fatalf("bad patches changed the policy: %+v %v", st, err)
	}
}

// TestNetworkPolicyAPI: a policy on create reaches the node before the sandbox starts,
// is shown without secrets, changes by merge patch and by replacement, and a change
// the node cannot apply leaves the previous policy in force (recorded and applied) with
// the reason in the error.
func TestNetworkPolicyAPI(t *testing.T) {
	s, fn := netSpace(t, nil)
	c := ctx(t)
	spec := &api.Network{
		Egress:   true,
		AllowOut: []string{"api.example.com"},
		DenyOut:  []string{"0.0.0.0/0"},
		Rules: map[string][]api.NetworkRule{"api.example.com": {{Transform: &api.NetworkTransform{
			Headers: map[string]string{"Authorization": "Bearer sk-secret"}}}}},
		EgressProxy: &api.EgressProxy{Address: "proxy.example.com:1080", Username: "u", Password: "p4ss"},
	}
	sb := s.Create(api.CreateSandboxRequest{Network: spec})
	if fn.Setups[sb.ID] == 0 || fn.Spec(sb.ID) == nil || fn.Spec(sb.ID).Rules["api.example.com"][0].Transform.Headers["Authorization"] != "Bearer sk-secret" {
		t.Fatalf("the node did not set up the policy: setups %d, spec %+v", fn.Setups[sb.ID], fn.Spec(sb.ID))
	}
	// No secret in any answer.
	for _, path := range []string{"/v1/sandboxes/" + sb.ID, "/v1/sandboxes/" + sb.ID + "/network", "/v1/sandboxes"} {
		code, body := do(t, s, "GET", path, "")
		if code != 200 || strings.Contains(body, "sk-secret") || strings.Contains(body, "p4ss") {
			t.Fatalf("GET %s: %d, shows a secret: %s", path, code, body)
		}
		if !strings.Contains(body, api.RedactedValue) {
			t.Fatalf("GET %s: %s lacks the redacted header", path, body)
		}
	}
	st, err := s.C.GetNetwork(c, sb.ID)
	if err != nil || !st.Applied || st.Address == "" || !strings.Contains(st.Policy, "socks5=proxy.example.com:1080") {
		t.Fatalf("network state %+v %v", st, err)
	}

	// Merge patch: only allow_out changes; the proxy's password and the rule's secret stay.
	st, err = s.C.PatchNetwork(c, sb.ID, map[string]any{"allow_out": []string{"api.example.com", "pypi.org"}})
	if err != nil || !st.Applied || len(st.Network.AllowOut) != 2 {
		t.Fatalf("patch: %+v %v", st, err)
	}
	got := fn.Spec(sb.ID)
	if len(got.AllowOut) != 2 || got.EgressProxy == nil || got.EgressProxy.Password != "p4ss" ||
		got.Rules["api.example.com"][0].Transform.Headers["Authorization"] != "Bearer sk-secret" {
		t.Fatalf("after the patch the node has %+v", got)
	}
	// null removes.
	if _, err := s.C.PatchNetwork(c, sb.ID, map[string]any{"egress_proxy": nil, "rules": nil}); err != nil {
		t.Fatal(err)
	}
	if got := fn.Spec(sb.ID); got.EgressProxy != nil || got.Rules != nil || len(got.AllowOut) != 2 {
		t.Fatalf("after removing the proxy and rules the node has %+v", got)
	}
	// PUT replaces whole.
	if _, err := s.C.SetNetwork(c, sb.ID, api.Network{Egress: true, DenyOut: []string{"198.51.100.0/24"}}); err != nil {
		t.Fatal(err)
	}
	if got := fn.Spec(sb.ID); len(got.AllowOut) != 0 || len(got.DenyOut) != 1 {
		t.Fatalf("after PUT the node has %+v", got)
	}

	// A change the node cannot apply: 422 with the reason; the previous policy is in
	// force and recorded.
	fn.FailNextUpdate(errors.New("nftables: batch refused by the kernel (test)"))
	code, body := do(t, s, "PATCH", "/v1/sandboxes/"+sb.ID+"/network", `{"deny_out":["0.0.0.0/0"]}`)
	if code != http.StatusUnprocessableEntity || !strings.Contains(body, "previous policy is still in force") || !strings.Contains(body, "batch refused") {
		t.Fatalf("failed apply: %d %s", code, body)
	}
	if got := fn.Spec(sb.ID); len(got.DenyOut) != 1 || got.DenyOut[0] != "198.51.100.0/24" {
		t.Fatalf("a failed apply changed the node's policy: %+v", got)
	}
	st, err = s.C.GetNetwork(c, sb.ID)
	if err != nil || len(st.Network.DenyOut) != 1 || st.Network.DenyOut[0] != "198.51.100.0/24" {
		t.Fatalf("a failed apply changed the recorded policy: %+v %v", st, err)
	}
	row, err := s.Store.GetSandbox(c, sb.ID)
	if err != nil || row.Spec.Network.DenyOut[0] != "198.51.100.0/24" {
		t.Fatalf("stored policy: %+v %v", row.Spec.Network, err)
	}

	// Suspend and wake: the node sets the recorded policy up again before the restore.
	before := fn.Setups[sb.ID]
	if _, err := s.C.LifecycleAndWait(c, sb.ID, api.OpSuspend); err != nil {
		t.Fatal(err)
	}
	// A change while suspended is in force at once (the namespace stays) and after wake.
	if _, err := s.C.PatchNetwork(c, sb.ID, map[string]any{"allow_out": []string{"wake.example.com"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.C.LifecycleAndWait(c, sb.ID, api.OpWake); err != nil {
		t.Fatal(err)
	}
	if fn.Setups[sb.ID] <= before || len(fn.Spec(sb.ID).AllowOut) != 1 || fn.Spec(sb.ID).AllowOut[0] != "wake.example.com" {
		t.Fatalf("after wake: setups %d (before %d), spec %+v", fn.Setups[sb.ID], before, fn.Spec(sb.ID))
	}

	// A clone has the policy, and its own network.
	clones, err := s.C.Clone(c, sb.ID, api.CloneRequest{})
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(clones[0].Operation.ID, api.OpSucceeded)
	cst, err := s.C.GetNetwork(c, clones[0].ID)
	if err != nil || !cst.Applied || cst.Address == st.Address || len(cst.Network.AllowOut) != 1 {
		t.Fatalf("clone network %+v (source %s) %v", cst, st.Address, err)
	}

	// Delete: the node tears the network down.
	op, err := s.C.DeleteSandbox(c, clones[0].ID)
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(op.ID, api.OpSucceeded)
	if fn.Spec(clones[0].ID) != nil {
		t.Fatal("the deleted clone's network is still set up")
	}
}

// TestNetworkWithoutNamespace: a sandbox created without a policy has no network; its
// policy cannot be changed (409 saying why) and it has no netlog. Another tenant's
// sandbox answers 404.
func TestNetworkWithoutNamespace(t *testing.T) {
	s, fn := netSpace(t, nil)
	sb := s.Create(api.CreateSandboxRequest{})
	if sb.Network != nil || fn.Setups[sb.ID] != 0 {
		t.Fatalf("a sandbox without a policy got a network: %+v, setups %d", sb.Network, fn.Setups[sb.ID])
	}
	code, body := do(t, s, "PATCH", "/v1/sandboxes/"+sb.ID+"/network", `{"egress":true}`)
	if code != http.StatusConflict || !strings.Contains(body, "created without a network") {
		t.Fatalf("patch of a sandbox without a network: %d %s", code, body)
	}
	code, body = do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/netlog?follow=false", "")
	if code != http.StatusConflict || !strings.Contains(body, "no network") {
		t.Fatalf("netlog of a sandbox without a network: %d %s", code, body)
	}
	st, err := s.C.GetNetwork(ctx(t), sb.ID)
	if err != nil || st.Applied || st.Network.Egress {
		t.Fatalf("network of a sandbox without one: %+v %v", st, err)
	}
	// Closed: a namespace with egress off, opened later.
	closed := s.Create(api.CreateSandboxRequest{Network: &api.Network{}})
	if fn.Setups[closed.ID] == 0 {
		t.Fatal("a closed policy set up no network")
	}
	if st, err := s.C.PatchNetwork(ctx(t), closed.ID, map[string]any{"egress": true}); err != nil || !st.Applied || !st.Network.Egress {
		t.Fatalf("opening a closed sandbox: %+v %v", st, err)
	}
	// Another tenant sees nothing.
	other := client.New(s.URL, s.NewKey("other", false, service.KeySpace))
	if _, err := other.GetNetwork(ctx(t), closed.ID); !client.IsNotFound(err) {
		t.Fatalf("another tenant's GET: %v", err)
	}
	if _, err := other.PatchNetwork(ctx(t), closed.ID, map[string]any{"egress": false}); !client.IsNotFound(err) {
		t.Fatalf("another tenant's PATCH: %v", err)
	}
	if err := other.FollowNetLog(ctx(t), closed.ID, client.NetLogOptions{}, func(api.NetworkEvent, int64) error { return nil }); !client.IsNotFound(err) {
		t.Fatalf("another tenant's netlog: %v", err)
	}
}

// TestNetworkDefaultEgress: the operator's default applies to creates without a policy;
// such sandboxes are never served from a warm pool.
func TestNetworkDefaultEgress(t *testing.T) {
	s, fn := netSpace(t, func(c *service.Config) { c.Network.Default = &api.Network{Egress: true} })
	sb := s.Create(api.CreateSandboxRequest{})
	if sb.Network == nil || !sb.Network.Egress || fn.Spec(sb.ID) == nil || !fn.Spec(sb.ID).Egress {
		t.Fatalf("default egress: %+v, node %+v", sb.Network, fn.Spec(sb.ID))
	}
	// An explicit policy wins over the default.
	sb2 := s.Create(api.CreateSandboxRequest{Network: &api.Network{Egress: true, DenyOut: []string{"0.0.0.0/0"}}})
	if len(sb2.Network.DenyOut) != 1 {
		t.Fatalf("explicit policy: %+v", sb2.Network)
	}
}

// TestNetlogReplay: the audit log streams as SSE with offsets: a reader resumes after
// the last id it got (Last-Event-ID), follows new entries, and learns of entries
// dropped from the bounded journal (gap).
func TestNetlogReplay(t *testing.T) {
	s, fn := netSpace(t, nil)
	c := ctx(t)
	sb := s.Create(api.CreateSandboxRequest{Network: &api.Network{Egress: true}})
	jr := fn.Journal(sb.ID)
	for i := range 10 {
		jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetAllowed, Reason: "open", Protocol: "tcp",
			Destination: "198.51.100." + string(rune('0'+i)) + ":443"})
	}
	var got []api.NetworkEvent
	if err := s.C.FollowNetLog(c, sb.ID, client.NetLogOptions{}, func(ev api.NetworkEvent, gap int64) error {
		got = append(got, ev)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if len(got) != 10 || got[0].Offset != 0 || got[9].Offset != 9 {
		t.Fatalf("netlog: %+v", got)
	}
	// Resume with Last-Event-ID: the event ids are the offsets to resume from.
	code, body := do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/netlog?follow=false", "", "Last-Event-ID", "8")
	if code != 200 || strings.Count(body, "event: network") != 2 || !strings.Contains(body, "id: 10\n") || strings.Contains(body, "id: 8\n") {
		t.Fatalf("resume at 8: %d %s", code, body)
	}

	// Follow: new entries arrive as they are appended.
	fctx, cancel := context.WithTimeout(c, 30*time.Second)
	defer cancel()
	seen := make(chan api.NetworkEvent, 16)
	done := make(chan error, 1)
	go func() {
		done <- s.C.FollowNetLog(fctx, sb.ID, client.NetLogOptions{From: 10, Follow: true}, func(ev api.NetworkEvent, gap int64) error {
			seen <- ev
			return nil
		})
	}()
	jr.Append(api.NetworkEvent{Kind: api.NetEventDNS, Verdict: api.NetDenied, Reason: "not_allowed", Protocol: "dns", Domain: "evil.example"})
	select {
	case ev := <-seen:
		if ev.Offset != 10 || ev.Domain != "evil.example" {
			t.Fatalf("followed event %+v", ev)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a new entry did not reach the follower")
	}
	cancel()
	<-done

	// The journal keeps 64 entries (the fake's bound): a reader from 0 gets a gap.
	for range 100 {
		jr.Append(api.NetworkEvent{Kind: api.NetEventConnect, Verdict: api.NetAllowed, Protocol: "udp", Destination: "198.51.100.1:53"})
	}
	code, body = do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/netlog?follow=false&from=0", "")
	if code != 200 || !strings.Contains(body, "event: gap") {
		t.Fatalf("netlog after overflow: %d %.300s", code, body)
	}
	gapLine := body[strings.Index(body, "event: gap"):]
	gapLine = gapLine[strings.Index(gapLine, "data: ")+6:]
	var g api.GapEvent
	if err := json.Unmarshal([]byte(gapLine[:strings.Index(gapLine, "\n")]), &g); err != nil || g.Dropped != 111-64 || g.Offset != 111-64 {
		t.Fatalf("gap %+v %v", g, err)
	}
	if code, body := do(t, s, "GET", "/v1/sandboxes/"+sb.ID+"/netlog?from=-1", ""); code != 400 || !strings.Contains(body, "non-negative") {
		t.Fatalf("bad offset: %d %s", code, body)
	}
}

package server_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/spacetest"
	"github.com/spacedev/space/internal/store"
)

// quotaSpace is a space without a node (sandboxes stay pending, operations open: both
// count) and a tenant "q" with a member and an admin key.
func quotaSpace(t *testing.T, opts spacetest.Options) (s *spacetest.Space, member, admin string) {
	t.Helper()
	s = spacetest.Start(t, opts)
	if _, err := s.C.CreateTenant(ctx(t), "q"); err != nil {
		t.Fatal(err)
	}
	_, member = s.NewKeyRole("q", store.RoleMember, "space")
	_, admin = s.NewKeyRole("q", store.RoleAdmin, "space")
	return s, member, admin
}

func setQuota(t *testing.T, s *spacetest.Space, req api.SetQuotaRequest) *api.Tenant {
	t.Helper()
	tn, err := s.C.SetQuota(ctx(t), "q", req)
	if err != nil {
		t.Fatal(err)
	}
	return tn
}

func n(v int64) *int64 { return &v }

// send sends a request with key and decodes an error body, if any.
func send(t *testing.T, s *spacetest.Space, key, method, path, body string) (int, api.ErrorBody, http.Header) {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx(t), method, s.URL+path, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var e api.Error
	_ = json.NewDecoder(resp.Body).Decode(&e)
	return resp.StatusCode, e.Error, resp.Header
}

func usage(t *testing.T, tn *api.Tenant, name string) api.QuotaUsage {
	t.Helper()
	for _, q := range tn.Quota {
		if q.Name == name {
			return q
		}
	}
	t.Fatalf("tenant %s has no quota %s", tn.Name, name)
	return api.QuotaUsage{}
}

// TestQuotas: a request over a tenant's quota is refused with 403 quota_exceeded and
// a body naming the limit, its value and the usage, before anything is stored; deletes
// are never refused; space tenant get shows usage against quota.
func TestQuotas(t *testing.T) {
	// Sandboxes that ask for no disk get 1024 MiB (their disk quota charge).
	s, member, admin := quotaSpace(t, spacetest.Options{NoNode: true, Service: func(c *service.Config) { c.DefaultDiskMB = 1024 }})
	count := func() int {
		list, err := s.Store.ListSandboxes(ctx(t), store.SandboxFilter{Tenant: "q", IncludeDeleted: true})
		if err != nil {
			t.Fatal(err)
		}
		return len(list)
	}
	tn := setQuota(t, s, api.SetQuotaRequest{RunningSandboxes: n(2), VCPUs: n(3), Reset: []string{"memory_mb"}})
	if q := usage(t, tn, "running_sandboxes"); q.Limit != 2 || q.Default || q.Usage != 0 {
		t.Fatalf("running quota %+v", q)
	}
	if q := usage(t, tn, "memory_mb"); !q.Default {
		t.Fatalf("memory quota %+v", q)
	}
	create := func(body string) (int, api.ErrorBody) {
		code, e, _ := send(t, s, member, "POST", "/v1/sandboxes", body)
		return code, e
	}
	if code, e := create(`{"cpu":2}`); code != 202 {
		t.Fatalf("first create: %d %+v", code, e)
	}
	// vCPUs: 2 used of 3, a second cpu-2 sandbox needs 2 more.
	code, e := create(`{"cpu":2}`)
	if code != 403 || e.Code != "quota_exceeded" || e.Limit == nil || *e.Limit != (api.LimitExceeded{Name: "vcpus", Limit: 3, Usage: 2, Requested: 2}) ||
		!strings.Contains(e.Message, "3 vCPUs") {
		t.Fatalf("over the vCPU quota: %d %+v %+v", code, e, e.Limit)
	}
	if code, e := create(`{"cpu":1}`); code != 202 {
		t.Fatalf("second create: %d %+v", code, e)
	}
	// Running sandboxes: 2 of 2.
	code, e = create(`{}`)
	if code != 403 || e.Limit == nil || *e.Limit != (api.LimitExceeded{Name: "running_sandboxes", Limit: 2, Usage: 2, Requested: 1}) {
		t.Fatalf("over the running quota: %d %+v", code, e)
	}
	if got := count(); got != 2 {
		t.Fatalf("refused creates stored sandboxes: %d", got)
	}
	// Another tenant is not affected; the operator's get shows usage against quota.
	if _, err := s.C.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, ""); err != nil {
		t.Fatalf("another tenant's create: %v", err)
	}
	got, err := s.C.GetTenant(ctx(t), "q")
	if err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]int64{"running_sandboxes": 2, "vcpus": 3, "memory_mb": 1024, "disk_mb": 2048, "operations": 2} {
		if q := usage(t, got, name); q.Usage != want {
			t.Errorf("usage of %s: %+v, want %d", name, q, want)
		}
	}
	// A member may read its own tenant, not another.
	if tn, err := client.New(s.URL, member).GetTenant(ctx(t), "q"); err != nil || tn.Name != "q" {
		t.Fatalf("member's own tenant: %v", err)
	}

	// Operations: the pending creates hold 2; a limit of 2 refuses a pause of one of
	// them, never its delete.
	setQuota(t, s, api.SetQuotaRequest{Operations: n(2), Reset: []string{"running_sandboxes", "vcpus"}})
	list, err := client.New(s.URL, member).ListSandboxes(ctx(t), client.ListOptions{})
	if err != nil || len(list) != 2 {
		t.Fatalf("list %v %v", list, err)
	}
	code, e = create(`{}`)
	if code != 403 || e.Limit == nil || e.Limit.Name != "operations" || e.Limit.Usage != 2 {
		t.Fatalf("over the operations quota: %d %+v", code, e)
	}
	if code, e, _ := send(t, s, member, "DELETE", "/v1/sandboxes/"+list[0].ID, ""); code != 202 {
		t.Fatalf("delete at the operations quota: %d %+v", code, e)
	}

	// Disk: every live sandbox is charged its disk_mb (1024 MiB here).
	setQuota(t, s, api.SetQuotaRequest{DiskMB: n(2500), Operations: n(-1)})
	if code, e := create(`{}`); code != 202 { // 2 live (one being deleted: not charged) + 1
		t.Fatalf("create within the disk quota: %d %+v", code, e)
	}
	code, e = create(`{}`)
	if code != 403 || e.Limit == nil || e.Limit.Name != "disk_mb" || e.Limit.Usage != 2048 || e.Limit.Requested != 1024 {
		t.Fatalf("over the disk quota: %d %+v", code, e)
	}

	// A pool's parked members count too.
	setQuota(t, s, api.SetQuotaRequest{RunningSandboxes: n(3), DiskMB: n(-1)})
	code, e, _ = send(t, s, admin, "PUT", "/v1/pools", `{"template":"base","size":2}`)
	if code != 403 || e.Limit == nil || e.Limit.Name != "running_sandboxes" || e.Limit.Requested != 2 {
		t.Fatalf("a pool over the quota: %d %+v", code, e)
	}
	if code, e, _ := send(t, s, admin, "PUT", "/v1/pools", `{"template":"base","size":1}`); code != 200 {
		t.Fatalf("a pool within the quota: %d %+v", code, e)
	}
	if code, e := create(`{}`); code != 403 || e.Limit == nil || e.Limit.Name != "running_sandboxes" || e.Limit.Usage != 3 {
		t.Fatalf("create after the pool took the rest: %d %+v", code, e)
	}

	// Bad quota requests.
	for _, body := range []string{`{}`, `{"vcpus":-2}`, `{"request_rate":0}`, `{"reset":["nope"]}`, `{"vcpus":1,"reset":["vcpus"]}`} {
		if code, e, _ := send(t, s, s.AdminKey, "PUT", "/v1/tenants/q/quota", body); code != 400 {
			t.Errorf("set-quota %s: %d %+v", body, code, e)
		}
	}
	if code, _, _ := send(t, s, admin, "PUT", "/v1/tenants/q/quota", `{"vcpus":100}`); code != 403 {
		t.Errorf("a tenant's admin set its own quota: %d", code)
	}
}

// TestQuotaRace: concurrent creates of one tenant never pass on the same headroom.
func TestQuotaRace(t *testing.T) {
	s, member, _ := quotaSpace(t, spacetest.Options{NoNode: true})
	setQuota(t, s, api.SetQuotaRequest{RunningSandboxes: n(3)})
	var wg sync.WaitGroup
	var mu sync.Mutex
	codes := map[int]int{}
	for range 12 {
		wg.Go(func() {
			code, _, _ := send(t, s, member, "POST", "/v1/sandboxes", `{}`)
			mu.Lock()
			codes[code]++
			mu.Unlock()
		})
	}
	wg.Wait()
	list, err := s.Store.ListSandboxes(ctx(t), store.SandboxFilter{Tenant: "q"})
	if codes[202] != 3 || codes[403] != 9 || err != nil || len(list) != 3 {
		t.Fatalf("12 concurrent creates under a quota of 3: %v, %d stored (%v)", codes, len(list), err)
	}
}

// TestQuotaWake: waking a suspended sandbox makes it hold memory again, so it is
// refused when the tenant has no room; suspending frees the room.
func TestQuotaWake(t *testing.T) {
	s, member, _ := quotaSpace(t, spacetest.Options{})
	c := client.New(s.URL, member)
	setQuota(t, s, api.SetQuotaRequest{RunningSandboxes: n(1)})
	first, err := c.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatal(err)
	}
	s.WaitOp(first.Operation.ID, api.OpSucceeded)
	if _, err := c.LifecycleAndWait(ctx(t), first.ID, api.OpSuspend); err != nil {
		t.Fatal(err)
	}
	second, err := c.CreateSandbox(ctx(t), api.CreateSandboxRequest{}, "")
	if err != nil {
		t.Fatalf("create after a suspend freed the room: %v", err)
	}
	s.WaitOp(second.Operation.ID, api.OpSucceeded)
	code, e, _ := send(t, s, member, "POST", "/v1/sandboxes/"+first.ID+"/wake", "")
	if code != 403 || e.Limit == nil || e.Limit.Name != "running_sandboxes" {
		t.Fatalf("wake over the quota: %d %+v", code, e)
	}
	// A request that would wake it on its own is refused the same way.
	code, e, _ = send(t, s, member, "GET", "/v1/sandboxes/"+first.ID+"/processes", "")
	if code != 403 || e.Code != "quota_exceeded" {
		t.Fatalf("a request waking over the quota: %d %+v", code, e)
	}
	if sb, _ := c.GetSandbox(ctx(t), first.ID); sb.DesiredState != api.StateSuspended {
		t.Fatalf("refused wake changed the sandbox: %+v", sb)
	}
}

// TestRateLimit: a tenant's request rate is a token bucket; past it, 429 with the
// limit in the body and Retry-After. Other tenants and operators are not affected.
func TestRateLimit(t *testing.T) {
	s, member, _ := quotaSpace(t, spacetest.Options{NoNode: true, NoController: true})
	setQuota(t, s, api.SetQuotaRequest{RequestRate: n(1), RequestBurst: n(3)})
	var last int
	var e api.ErrorBody
	var hdr http.Header
	for i := range 4 {
		if last, e, hdr = send(t, s, member, "GET", "/v1/sandboxes", ""); i < 3 && last != 200 {
			t.Fatalf("request %d within the burst: %d %+v", i, last, e)
		}
	}
	if last != 429 || e.Code != "too_many_requests" || e.Limit == nil || e.Limit.Name != "request_rate" || e.Limit.Limit != 1 ||
		hdr.Get("Retry-After") == "" {
		t.Fatalf("past the burst: %d %+v %v", last, e, hdr)
	}
	for range 5 {
		if code, e, _ := send(t, s, s.AdminKey, "GET", "/v1/sandboxes", ""); code != 200 {
			t.Fatalf("the operator was limited: %d %+v", code, e)
		}
	}
	_, other := s.NewKeyRole("other", store.RoleMember, "space")
	if code, _, _ := send(t, s, other, "GET", "/v1/sandboxes", ""); code != 200 {
		t.Fatalf("another tenant was limited: %d", code)
	}
}

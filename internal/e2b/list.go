package e2b

import (
	"encoding/base64"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/service"
	"github.com/spacedev/space/internal/store"
)

// listScan bounds how many sandboxes one list request reads before filtering and
// paginating in memory.
const listScan = 10000

// parseMetadataQuery decodes the metadata filter the SDKs send: "k1=v1&k2=v2" built
// from percent-encoded keys and values, passed as one query parameter. After the
// usual query decoding the whole string is unescaped once more, split, and each key
// and value unescaped again (as upstream does).
func parseMetadataQuery(s string) (map[string]string, error) {
	if s == "" {
		return nil, nil
	}
	whole, err := url.QueryUnescape(s)
	if err != nil {
		return nil, fault.New(fault.Invalid, "metadata filter: %v", err)
	}
	out := map[string]string{}
	for _, pair := range strings.Split(whole, "&") {
		if pair == "" {
			continue
		}
		kv := strings.Split(pair, "=")
		if len(kv) != 2 {
			return nil, fault.New(fault.Invalid, "metadata filter %q must look like key=value", pair)
		}
		k, err1 := url.QueryUnescape(kv[0])
		v, err2 := url.QueryUnescape(kv[1])
		if err1 != nil || err2 != nil || k == "" {
			return nil, fault.New(fault.Invalid, "metadata filter %q is malformed", pair)
		}
		out[k] = v
	}
	return out, nil
}

// parseStates reads state=running,paused (comma-separated and/or repeated).
func parseStates(vals []string, def []string) ([]string, error) {
	var out []string
	for _, v := range vals {
		for _, s := range strings.Split(v, ",") {
			switch s = strings.TrimSpace(s); s {
			case "running", "paused":
				if !slices.Contains(out, s) {
					out = append(out, s)
				}
			case "":
			default:
				return nil, fault.New(fault.Invalid, "state must be running or paused, not %q", s)
			}
		}
	}
	if len(out) == 0 {
		return def, nil
	}
	return out, nil
}

// cursor is the opaque page token: the start time and id of the last item served.
func cursor(sb *store.Sandbox) string {
	return base64.RawURLEncoding.EncodeToString([]byte(sb.CreatedAt.UTC().Format(time.RFC3339Nano) + "__" + sb.ID))
}

func parseCursor(s string) (time.Time, string, error) {
	b, err := base64.RawURLEncoding.DecodeString(s)
	if err == nil {
		ts, id, ok := strings.Cut(string(b), "__")
		if t, err := time.Parse(time.RFC3339Nano, ts); ok && err == nil {
			return t, id, nil
		}
	}
	return time.Time{}, "", fault.New(fault.Invalid, "nextToken is invalid")
}

// before orders sandboxes by start time, then id.
func before(a, b *store.Sandbox) bool {
	if !a.CreatedAt.Equal(b.CreatedAt) {
		return a.CreatedAt.Before(b.CreatedAt)
	}
	return a.ID < b.ID
}

// list handles GET /v2/sandboxes (filters, order, pagination) and the legacy GET
// /sandboxes (running sandboxes, metadata filter only).
func (g *Gateway) list(v2 bool) apiHandler {
	return func(w http.ResponseWriter, r *http.Request, p *service.Principal) error {
		q := r.URL.Query()
		md, err := parseMetadataQuery(q.Get("metadata"))
		if err != nil {
			return err
		}
		states := []string{"running"}
		limit, order := listScan, "desc"
		var startedAfter time.Time
		var template string
		var after *store.Sandbox
		if v2 {
			if states, err = parseStates(q["state"], []string{"running", "paused"}); err != nil {
				return err
			}
			if s := q.Get("startedAfter"); s != "" {
				if startedAfter, err = time.Parse(time.RFC3339Nano, s); err != nil {
					return fault.New(fault.Invalid, "startedAfter must be an RFC 3339 time")
				}
			}
			template = q.Get("template")
			switch order = q.Get("order"); order {
			case "":
				order = "desc"
			case "asc", "desc":
			default:
				return fault.New(fault.Invalid, "order must be asc or desc")
			}
			limit = maxListLimit
			if s := q.Get("limit"); s != "" {
				if limit, err = strconv.Atoi(s); err != nil || limit < 1 || limit > maxListLimit {
					return fault.New(fault.Invalid, "limit must be between 1 and %d", maxListLimit)
				}
			}
			if s := q.Get("nextToken"); s != "" {
				t, id, err := parseCursor(s)
				if err != nil {
					return err
				}
				after = &store.Sandbox{CreatedAt: t, ID: id}
			}
		}
		f := store.SandboxFilter{Metadata: md, Limit: listScan, Tenant: p.Tenant} // E2B keys are a tenant's members
		all, err := g.st.ListSandboxes(r.Context(), f)
		if err != nil {
			return err
		}
		var matches []*store.Sandbox
		running := 0
		for _, sb := range all {
			if sb.DeletedAt != nil || sb.DesiredState == api.StateDeleted || sb.State == api.StateFailed {
				continue
			}
			if !slices.Contains(states, e2bState(sb)) || sb.CreatedAt.Before(startedAfter) {
				continue
			}
			if id, alias := templateNames(sb.TemplateRef); template != "" && template != id && template != alias {
				continue
			}
			if e2bState(sb) == "running" {
				running++
			}
			matches = append(matches, sb)
		}
		slices.SortFunc(matches, func(a, b *store.Sandbox) int {
			less := before(a, b)
			if order == "desc" {
				less = before(b, a)
			}
			if less {
				return -1
			}
			return 1
		})
		if after != nil {
			i := slices.IndexFunc(matches, func(sb *store.Sandbox) bool {
				if order == "desc" {
					return before(sb, after)
				}
				return before(after, sb)
			})
			if i < 0 {
				i = len(matches)
			}
			matches = matches[i:]
		}
		if len(matches) > limit {
			matches = matches[:limit]
			w.Header().Set("X-Next-Token", cursor(matches[limit-1]))
		}
		if slices.Contains(states, "running") {
			w.Header().Set("X-Total-Running", strconv.Itoa(running))
		}
		out := make([]listedSandbox, 0, len(matches))
		for _, sb := range matches {
			out = append(out, listed(sb))
		}
		writeJSON(w, http.StatusOK, out)
		return nil
	}
}

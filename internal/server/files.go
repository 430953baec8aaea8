package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/fault"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/store"
)

// File endpoints stream through to the sandbox's agent (via its node): bodies are never
// buffered, so files of any size move in both directions with constant memory. Guest
// paths are passed to the agent, which resolves them inside the sandbox; no host path
// is ever derived from them.

// maxPathLen bounds guest paths.
const maxPathLen = 4096

// checkPath validates a guest path from a query parameter or body.
func checkPath(name, p string) error {
	if p == "" {
		return invalid("%s is required", name)
	}
	if len(p) > maxPathLen || strings.ContainsRune(p, 0) {
		return invalid("%s is too long or contains NUL", name)
	}
	return nil
}

// checkUser validates an optional user name.
func checkUser(u string) error {
	if u != "" && !userNameRe.MatchString(u) {
		return invalid("user %q is not a valid user name", u)
	}
	return nil
}

// proxyToAgent relays the request (method, body, selected query parameters) to the
// agent path and streams the answer back. Agent errors become API errors.
func (a *API) proxyToAgent(w http.ResponseWriter, r *http.Request, sb *store.Sandbox, agentPath string, query url.Values) error {
	node, err := a.runningOn(r.Context(), sb)
	if err != nil {
		return err
	}
	tok, err := a.nodeToken(sb)
	if err != nil {
		return err
	}
	target, err := url.Parse(node.DataPlaneURL)
	if err != nil {
		return err
	}
	var proxyErr error
	p := &httputil.ReverseProxy{
		Rewrite: func(pr *httputil.ProxyRequest) {
			pr.SetURL(target)
			pr.Out.URL.Path = "/internal/v1/sandboxes/" + sb.ID + "/agent" + agentPath
			pr.Out.URL.RawPath = ""
			pr.Out.URL.RawQuery = query.Encode()
			pr.Out.Header.Set("Authorization", "Bearer "+tok)
			pr.Out.Header.Del("X-Api-Key")
		},
		Transport:     a.cfg.NodeClient.Transport,
		FlushInterval: -1,
		ModifyResponse: func(resp *http.Response) error {
			if resp.StatusCode < 300 {
				return nil
			}
			return agentError(resp)
		},
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			proxyErr = err
		},
	}
	_ = http.NewResponseController(w).EnableFullDuplex() // see DataPlane.agentProxy
	p.ServeHTTP(w, r)
	if proxyErr != nil {
		if fault.KindOf(proxyErr) == fault.Internal && r.Context().Err() == nil {
			proxyErr = fault.New(fault.Unavailable, "node %s unreachable: %v", node.Name, proxyErr)
		}
		return proxyErr
	}
	return nil
}

// fileQuery copies the allowed query parameters after validating them.
func fileQuery(r *http.Request, names ...string) (url.Values, error) {
	in := r.URL.Query()
	out := url.Values{}
	for _, n := range names {
		v := in.Get(n)
		if v == "" {
			continue
		}
		switch n {
		case "path":
			if err := checkPath("path", v); err != nil {
				return nil, err
			}
		case "user":
			if err := checkUser(v); err != nil {
				return nil, err
			}
		case "offset", "length", "depth":
			if x, err := strconv.ParseInt(v, 10, 64); err != nil || x < 0 {
				return nil, invalid("%s must be a non-negative integer", n)
			}
		case "mode":
			if _, err := strconv.ParseUint(v, 8, 32); err != nil {
				return nil, invalid("mode must be octal, like 0644")
			}
		case "append", "recursive":
			if v != "1" && v != "true" && v != "0" && v != "false" {
				return nil, invalid("%s must be true or false", n)
			}
			if v == "true" {
				v = "1"
			}
		}
		out.Set(n, v)
	}
	if _, ok := out["path"]; !ok {
		return nil, invalid("path is required")
	}
	return out, nil
}

func (a *API) fileHandler(agentPath string, params ...string) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		sb, err := a.sandboxFor(r, r.PathValue("id"))
		if err != nil {
			return err
		}
		if sb, err = a.awake(r, sb); err != nil {
			return err
		}
		q, err := fileQuery(r, params...)
		if err != nil {
			return err
		}
		return a.proxyToAgent(w, r, sb, agentPath, q)
	}
}

// fileJSONHandler validates a JSON body of type T and relays it.
func fileJSONHandler[T any](a *API, agentPath string, check func(*T) error) handlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		sb, err := a.sandboxFor(r, r.PathValue("id"))
		if err != nil {
			return err
		}
		if sb, err = a.awake(r, sb); err != nil {
			return err
		}
		var req T
		if err := decodeJSON(w, r, &req); err != nil {
			return err
		}
		if err := check(&req); err != nil {
			return err
		}
		b, _ := json.Marshal(req)
		r.Body = io.NopCloser(bytes.NewReader(b))
		r.ContentLength = int64(len(b))
		return a.proxyToAgent(w, r, sb, agentPath, url.Values{})
	}
}

func (a *API) registerFiles(authed func(string, handlerFunc)) {
	authed("GET /v1/sandboxes/{id}/files", a.fileHandler("/v1/files/content", "path", "user", "offset", "length"))
	authed("PUT /v1/sandboxes/{id}/files", a.fileHandler("/v1/files/content", "path", "user", "mode", "append"))
	authed("DELETE /v1/sandboxes/{id}/files", a.fileHandler("/v1/files", "path", "user", "recursive"))
	authed("GET /v1/sandboxes/{id}/files/stat", a.fileHandler("/v1/files/stat", "path", "user"))
	authed("GET /v1/sandboxes/{id}/files/list", a.fileHandler("/v1/files/list", "path", "user", "depth"))
	authed("POST /v1/sandboxes/{id}/files/mkdir", fileJSONHandler(a, "/v1/files/mkdir", func(m *api.MkdirRequest) error {
		if err := checkPath("path", m.Path); err != nil {
			return err
		}
		return checkUser(m.User)
	}))
	authed("POST /v1/sandboxes/{id}/files/move", fileJSONHandler(a, "/v1/files/move", func(m *api.MoveRequest) error {
		if err := checkPath("from", m.From); err != nil {
			return err
		}
		if err := checkPath("to", m.To); err != nil {
			return err
		}
		return checkUser(m.User)
	}))
	authed("GET /v1/sandboxes/{id}/files/watch", a.watchFiles)
}

// watchFiles turns the agent's newline-delimited watch events into SSE.
func (a *API) watchFiles(w http.ResponseWriter, r *http.Request) error {
	sb, err := a.sandboxFor(r, r.PathValue("id"))
	if err != nil {
		return err
	}
	if sb, err = a.awake(r, sb); err != nil {
		return err
	}
	q, err := fileQuery(r, "path", "user", "recursive")
	if err != nil {
		return err
	}
	node, err := a.runningOn(r.Context(), sb)
	if err != nil {
		return err
	}
	tok, err := a.nodeToken(sb)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet,
		node.DataPlaneURL+"/internal/v1/sandboxes/"+sb.ID+"/agent/v1/files/watch?"+q.Encode(), nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+tok)
	resp, err := a.cfg.NodeClient.Do(req)
	if err != nil {
		return fault.New(fault.Unavailable, "node %s unreachable: %v", node.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return agentError(resp)
	}
	s := newSSE(w)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var ev wire.WatchEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			_ = s.event("", api.EventError, map[string]string{"message": fmt.Sprintf("bad watch event: %v", err)})
			return nil
		}
		if ev.Type == wire.WatchHeartbeat {
			err = s.comment("keepalive")
		} else {
			err = s.event("", ev.Type, api.WatchEvent{Type: ev.Type, Path: ev.Path, Name: ev.Name, IsDir: ev.IsDir})
		}
		if err != nil || s.flush() != nil {
			return nil
		}
	}
	return nil
}

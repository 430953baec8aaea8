package server

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/internal/guest/agentclient"
	"github.com/spacedev/space/internal/guest/wire"
	"github.com/spacedev/space/internal/rest"
	"github.com/spacedev/space/internal/service"
)

// File endpoints go to the sandbox's agent (via its node): file contents are never
// buffered, so files of any size move in both directions with constant memory; the
// agent's small JSON answers (stat, list, mkdir, move, write) are decoded with bounds by
// the agent client and written by the API itself. Guest
// paths are passed to the agent, which resolves them inside the sandbox; no host path
// is ever derived from them.

// maxPathLen bounds guest paths.
const maxPathLen = 4096

// checkPath validates a guest path from a query parameter or body.
func checkPath(name, p string) error {
	if p == "" {
		return rest.Invalid("%s is required", name)
	}
	if len(p) > maxPathLen || strings.ContainsRune(p, 0) {
		return rest.Invalid("%s is too long or contains NUL", name)
	}
	return nil
}

// proxyToAgent relays the request (method, body, selected query parameters) to the
// agent path and streams the answer back. Agent errors become API errors.
func (a *API) proxyToAgent(w http.ResponseWriter, r *http.Request, t *service.Target, agentPath string, query url.Values) error {
	agent, err := a.svc.Agent(r.Context(), t)
	if err != nil {
		return err
	}
	return agent.Relay(w, r, agentPath, query, a.log)
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
			if err := service.ValidUser(v); err != nil {
				return nil, err
			}
		case "offset", "length", "depth":
			if x, err := strconv.ParseInt(v, 10, 64); err != nil || x < 0 {
				return nil, rest.Invalid("%s must be a non-negative integer", n)
			}
		case "mode":
			if _, err := strconv.ParseUint(v, 8, 32); err != nil {
				return nil, rest.Invalid("mode must be octal, like 0644")
			}
		case "append", "recursive":
			if v != "1" && v != "true" && v != "0" && v != "false" {
				return nil, rest.Invalid("%s must be true or false", n)
			}
			if v == "true" {
				v = "1"
			}
		}
		out.Set(n, v)
	}
	if _, ok := out["path"]; !ok {
		return nil, rest.Invalid("path is required")
	}
	return out, nil
}

// running loads the request's sandbox for the caller, waking it unless ?wake=false.
func (a *API) running(r *http.Request) (*service.Target, error) {
	nw, err := noWake(r)
	if err != nil {
		return nil, err
	}
	return a.svc.Running(r.Context(), principalFrom(r.Context()), r.PathValue("id"), nw)
}

func (a *API) fileHandler(agentPath string, params ...string) rest.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		t, err := a.running(r)
		if err != nil {
			return err
		}
		q, err := fileQuery(r, params...)
		if err != nil {
			return err
		}
		return a.proxyToAgent(w, r, t, agentPath, q)
	}
}

// fileCall runs one typed agent call for a file endpoint whose answer is small JSON: the
// agent client bounds and decodes the agent's reply (a hostile agent's oversized or
// malformed answer becomes a 502), and the API writes its own JSON.
func fileCall(a *API, params []string, call func(r *http.Request, c *agentclient.Client, q url.Values) (status int, v any, err error)) rest.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		t, err := a.running(r)
		if err != nil {
			return err
		}
		q, err := fileQuery(r, params...)
		if err != nil {
			return err
		}
		agent, err := a.svc.Agent(r.Context(), t)
		if err != nil {
			return err
		}
		status, v, err := call(r, agent, q)
		if err != nil {
			return err
		}
		if v == nil {
			w.WriteHeader(status)
			return nil
		}
		rest.WriteJSON(w, status, v)
		return nil
	}
}

// fileJSONCall is fileCall for endpoints with a JSON body of type T, validated by check.
func fileJSONCall[T any](a *API, check func(*T) error, call func(r *http.Request, c *agentclient.Client, req *T) (int, any, error)) rest.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) error {
		t, err := a.running(r)
		if err != nil {
			return err
		}
		var req T
		if err := rest.DecodeJSON(w, r, &req); err != nil {
			return err
		}
		if err := check(&req); err != nil {
			return err
		}
		agent, err := a.svc.Agent(r.Context(), t)
		if err != nil {
			return err
		}
		status, v, err := call(r, agent, &req)
		if err != nil {
			return err
		}
		rest.WriteJSON(w, status, v)
		return nil
	}
}

// fileInfo is the API's form of an agent's entry (the same fields).
func fileInfo(e wire.EntryInfo) api.FileInfo { return api.FileInfo(e) }

func (a *API) registerFiles(authed func(string, rest.HandlerFunc)) {
	// The file's contents stream through unchanged (any size, constant memory).
	authed("GET /v1/sandboxes/{id}/files", a.fileHandler("/v1/files/content", "path", "user", "offset", "length"))
	authed("PUT /v1/sandboxes/{id}/files", fileCall(a, []string{"path", "user", "mode", "append"},
		func(r *http.Request, c *agentclient.Client, q url.Values) (int, any, error) {
			opts := agentclient.WriteOptions{User: q.Get("user"), Append: q.Get("append") == "1"}
			if m := q.Get("mode"); m != "" {
				mode, _ := strconv.ParseUint(m, 8, 32) // validated by fileQuery
				opts.Mode = uint32(mode)
			}
			info, err := c.WriteFile(r.Context(), q.Get("path"), r.Body, opts)
			return http.StatusOK, fileInfo(info), err
		}))
	authed("DELETE /v1/sandboxes/{id}/files", fileCall(a, []string{"path", "user", "recursive"},
		func(r *http.Request, c *agentclient.Client, q url.Values) (int, any, error) {
			return http.StatusNoContent, nil, c.Remove(r.Context(), q.Get("path"), q.Get("user"), q.Get("recursive") == "1")
		}))
	authed("GET /v1/sandboxes/{id}/files/stat", fileCall(a, []string{"path", "user"},
		func(r *http.Request, c *agentclient.Client, q url.Values) (int, any, error) {
			info, err := c.Stat(r.Context(), q.Get("path"), q.Get("user"))
			return http.StatusOK, fileInfo(info), err
		}))
	authed("GET /v1/sandboxes/{id}/files/list", fileCall(a, []string{"path", "user", "depth"},
		func(r *http.Request, c *agentclient.Client, q url.Values) (int, any, error) {
			depth, _ := strconv.Atoi(q.Get("depth")) // validated by fileQuery
			entries, err := c.List(r.Context(), q.Get("path"), q.Get("user"), depth)
			out := make([]api.FileInfo, 0, len(entries))
			for _, e := range entries {
				out = append(out, fileInfo(e))
			}
			return http.StatusOK, out, err
		}))
	authed("POST /v1/sandboxes/{id}/files/mkdir", fileJSONCall(a, func(m *api.MkdirRequest) error {
		if err := checkPath("path", m.Path); err != nil {
			return err
		}
		return service.ValidUser(m.User)
	}, func(r *http.Request, c *agentclient.Client, m *api.MkdirRequest) (int, any, error) {
		info, err := c.Mkdir(r.Context(), wire.MkdirRequest(*m))
		return http.StatusCreated, fileInfo(info), err
	}))
	authed("POST /v1/sandboxes/{id}/files/move", fileJSONCall(a, func(m *api.MoveRequest) error {
		if err := checkPath("from", m.From); err != nil {
			return err
		}
		if err := checkPath("to", m.To); err != nil {
			return err
		}
		return service.ValidUser(m.User)
	}, func(r *http.Request, c *agentclient.Client, m *api.MoveRequest) (int, any, error) {
		info, err := c.Move(r.Context(), wire.MoveRequest(*m))
		return http.StatusOK, fileInfo(info), err
	}))
	authed("GET /v1/sandboxes/{id}/files/watch", a.watchFiles)
}

// watchFiles turns the agent's newline-delimited watch events into SSE.
func (a *API) watchFiles(w http.ResponseWriter, r *http.Request) error {
	t, err := a.running(r)
	if err != nil {
		return err
	}
	q, err := fileQuery(r, "path", "user", "recursive")
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	agent, err := a.svc.Agent(ctx, t)
	if err != nil {
		return err
	}
	watch, err := agent.Watch(ctx, q.Get("path"), q.Get("user"), q.Get("recursive") == "1")
	if err != nil {
		return err
	}
	defer watch.Close()
	s := rest.NewSSE(w)
	// A watch never ends by itself: at a stop it ends at once, telling its client to
	// watch again (with the next process).
	defer rest.EndAtStop(r, cancel)()
	st := watch.Start
	if s.Event("", st.Type, api.WatchEvent{Type: st.Type, Path: st.Path, Name: st.Name, IsDir: st.IsDir}) != nil || s.Flush() != nil {
		return nil
	}
	for {
		ev, err := watch.Next()
		if err != nil {
			if rest.Stopping(ctx) {
				_ = s.Event("", api.EventError, map[string]string{"message": "space is restarting: watch again"})
			} else if err != io.EOF && ctx.Err() == nil {
				_ = s.Event("", api.EventError, map[string]string{"message": fmt.Sprintf("watch ended: %v; watch again", err)})
			}
			return nil
		}
		if ev.Type == wire.WatchHeartbeat {
			err = s.Comment("keepalive")
		} else {
			err = s.Event("", ev.Type, api.WatchEvent{Type: ev.Type, Path: ev.Path, Name: ev.Name, IsDir: ev.IsDir})
		}
		if err != nil || s.Flush() != nil {
			return nil
		}
	}
}

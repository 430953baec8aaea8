package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

func (a *app) templateCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "template", Aliases: []string{"templates"}, Short: "Build and manage templates"}
	cmd.AddCommand(a.templateListCmd(), a.templateGetCmd(), a.templateBuildCmd(), a.templateRmCmd())
	return cmd
}

func (a *app) templateListCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "list",
		Aliases: []string{"ls"},
		Short:   "List template releases and their tags",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			list, err := c.ListTemplates(cmdContext(cmd))
			if err != nil {
				return err
			}
			return printList(a, list, []string{"NAME", "TAGS", "DIGEST", "SIZE", "CREATED"}, func(t api.Template) []any {
				return []any{t.Name, strings.Join(t.Tags, ","), t.Digest, humanBytes(t.SizeBytes), ago(t.CreatedAt)}
			})
		},
	}
}

// templateInfo is the body of GET /v1/templates/{name}.
type templateInfo struct {
	Name     string            `json:"name"`
	Tags     map[string]string `json:"tags"`
	Releases []struct {
		Ref       string          `json:"ref"`
		Digest    string          `json:"digest"`
		Tags      []string        `json:"tags"`
		SizeBytes int64           `json:"size_bytes"`
		CreatedAt time.Time       `json:"created_at"`
		Config    json.RawMessage `json:"config"`
		Nodes     []string        `json:"nodes"`
	} `json:"releases"`
}

func (a *app) templateGetCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME",
		Short: "Show a template's releases, tags and configs",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			var raw json.RawMessage
			if err := templateCall(cmdContext(cmd), c, http.MethodGet, "/v1/templates/"+url.PathEscape(args[0]), nil, "", &raw); err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(raw)
			}
			var t templateInfo
			if err := json.Unmarshal(raw, &t); err != nil {
				return err
			}
			tags := make([]string, 0, len(t.Tags))
			for tag := range t.Tags {
				tags = append(tags, tag)
			}
			sort.Strings(tags)
			fmt.Fprintf(a.env.Stdout, "Template %s\n", t.Name)
			for _, tag := range tags {
				fmt.Fprintf(a.env.Stdout, "  %s:%s -> %s\n", t.Name, tag, t.Tags[tag])
			}
			fmt.Fprintln(a.env.Stdout)
			tw := a.table("RELEASE", "TAGS", "SIZE", "CREATED", "CONFIG")
			for _, r := range t.Releases {
				fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", r.Ref, strings.Join(r.Tags, ","), humanBytes(r.SizeBytes), ago(r.CreatedAt), r.Config)
			}
			return tw.Flush()
		},
	}
}

func (a *app) templateRmCmd() *cobra.Command {
	return &cobra.Command{
		Use:   "rm REF",
		Short: "Remove a tag (NAME:TAG) or delete a release (NAME@sha256:…)",
		Long: `Remove a tag (NAME:TAG): the release it pointed at stays, reachable by its digest.
Delete a release (NAME@sha256:…): it is removed from the database with the tags that
point at it, and its files from the nodes. A release that a sandbox still uses cannot
be deleted (delete those sandboxes first).`,
		Aliases: []string{"delete"},
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.connect()
			if err != nil {
				return err
			}
			var out struct {
				Deleted string   `json:"deleted"`
				Digest  string   `json:"digest"`
				Nodes   []string `json:"nodes"`
			}
			if err := templateCall(cmdContext(cmd), c, http.MethodDelete, "/v1/templates/"+url.PathEscape(args[0]), nil, "", &out); err != nil {
				return err
			}
			if a.json() {
				return a.printJSON(out)
			}
			if strings.Contains(out.Deleted, "@") {
				fmt.Fprintf(a.env.Stdout, "deleted release %s\n", out.Deleted)
			} else {
				fmt.Fprintf(a.env.Stdout, "removed tag %s (it pointed at %s)\n", out.Deleted, out.Digest)
			}
			return nil
		},
	}
}

func (a *app) templateBuildCmd() *cobra.Command {
	var file string
	var noFollow bool
	cmd := &cobra.Command{
		Use:   "build -f SPEC",
		Short: "Build a template from a spec file (YAML or JSON) and stream the build log",
		Long: `Build a template from a spec (see docs/templates.md). The build runs on a node as an
operation; its log (source progress, every step's output) streams here until it ends,
and space exits 1 if it failed. With --no-follow, only the queued operation is printed.
-f - reads the spec from stdin.`,
		Example: `  space template build -f python.yaml
  space template build -f spec.json --no-follow -o json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := a.checkOutput(); err != nil {
				return err
			}
			if file == "" {
				return errors.New("say which spec to build with -f FILE (or -f - for stdin)")
			}
			var data []byte
			var err error
			if file == "-" {
				data, err = io.ReadAll(a.env.Stdin)
			} else {
				data, err = os.ReadFile(file)
			}
			if err != nil {
				return err
			}
			ctype := "application/yaml"
			if strings.HasSuffix(strings.ToLower(file), ".json") {
				ctype = "application/json"
			}
			c, err := a.client()
			if err != nil {
				return err
			}
			ctx := cmdContext(cmd)
			op, err := c.BuildTemplate(ctx, data, ctype)
			if err != nil {
				return err
			}
			if noFollow {
				if a.json() {
					return a.printJSON(op)
				}
				fmt.Fprintf(a.env.Stdout, "%s\t%s\n", op.ID, op.Message)
				return nil
			}
			logOut := a.env.Stdout
			if a.json() {
				logOut = a.env.Stderr // stdout carries the final operation
			} else {
				fmt.Fprintf(a.env.Stdout, "operation %s: %s\n", op.ID, op.Message)
			}
			final, err := followOperation(ctx, c, op.ID, func(line string) { fmt.Fprintln(logOut, line) })
			if err != nil {
				return err
			}
			if a.json() {
				if err := a.printJSON(final); err != nil {
					return err
				}
			} else if final.State == api.OpSucceeded {
				fmt.Fprintln(a.env.Stdout, final.Message)
			} else {
				fmt.Fprintf(a.env.Stderr, "build %s: %s\n", final.State, final.Error)
			}
			if final.State != api.OpSucceeded {
				return &ExitError{Code: 1}
			}
			return nil
		},
	}
	cmd.Flags().StringVarP(&file, "file", "f", "", "the build spec (YAML, or JSON if it ends in .json; - for stdin)")
	cmd.Flags().BoolVar(&noFollow, "no-follow", false, "print the queued operation and return without streaming the log")
	return cmd
}

// templateCall makes one control-plane request the client package has no method for.
func templateCall(ctx context.Context, c *client.Client, method, path string, body io.Reader, ctype string, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, c.BaseURL+path, body)
	if err != nil {
		return err
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	req.Header.Set("Authorization", "Bearer "+c.APIKey)
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return apiError(resp)
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

func apiError(resp *http.Response) error {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var e api.Error
	if json.Unmarshal(b, &e) == nil && e.Error.Message != "" {
		return &client.Error{Status: resp.StatusCode, Code: e.Error.Code, Message: e.Error.Message}
	}
	return &client.Error{Status: resp.StatusCode, Code: http.StatusText(resp.StatusCode), Message: strings.TrimSpace(string(b))}
}

// followOperation streams an operation's events (GET /v1/operations/{id}/events),
// handing each log line to logLine once, until the operation is done. A dropped stream
// is reopened; lines already seen are skipped.
func followOperation(ctx context.Context, c *client.Client, id string, logLine func(string)) (*api.Operation, error) {
	var lastSeq int64
	var op *api.Operation
	for attempt := 0; ; attempt++ {
		err := streamOperation(ctx, c, id, func(event string, data []byte) error {
			switch event {
			case "log":
				var l struct {
					Seq  int64  `json:"seq"`
					Line string `json:"line"`
				}
				if err := json.Unmarshal(data, &l); err != nil {
					return err
				}
				if l.Seq > lastSeq {
					lastSeq = l.Seq
					logLine(l.Line)
				}
			case "operation":
				var o api.Operation
				if err := json.Unmarshal(data, &o); err != nil {
					return err
				}
				op = &o
			}
			return nil
		})
		var ae *client.Error
		if errors.As(err, &ae) {
			return nil, err
		}
		if op != nil && op.Done() && err == nil {
			return op, nil
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		// The stream ended early (a restart of the server, a proxy): reopen it.
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(min(time.Duration(attempt+1)*200*time.Millisecond, 2*time.Second)):
		}
	}
}

// streamOperation reads one SSE stream of operation events.
func streamOperation(ctx context.Context, c *client.Client, id string, fn func(event string, data []byte) error) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, c.BaseURL+"/v1/operations/"+url.PathEscape(id)+"/events", nil)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.APIKey)
	req.Header.Set("Accept", "text/event-stream")
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		return apiError(resp)
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	var event string
	var data []byte
	for sc.Scan() {
		line := sc.Text()
		switch {
		case line == "":
			if event != "" || len(data) > 0 {
				if err := fn(event, data); err != nil {
					return err
				}
			}
			event, data = "", nil
		case strings.HasPrefix(line, ":"):
		case strings.HasPrefix(line, "event:"):
			event = strings.TrimSpace(strings.TrimPrefix(line, "event:"))
		case strings.HasPrefix(line, "data:"):
			if len(data) > 0 {
				data = append(data, '\n')
			}
			data = append(data, strings.TrimPrefix(strings.TrimPrefix(line, "data:"), " ")...)
		}
	}
	return sc.Err()
}

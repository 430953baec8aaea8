// Package cli owns space's client commands (sandbox, exec, op, apikey, tenant, node, template,
// …): argument parsing, output formatting (text tables or -o json) and exit codes. The
// server command and environment lookups live in cmd/space, which hands an Env in.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/spacedev/space/api"
	"github.com/spacedev/space/client"
)

// Env is what the CLI learns from its environment.
type Env struct {
	// URL is the API endpoint (SPACE_URL).
	URL string
	// APIKey is the API key (SPACE_API_KEY); empty means read DataDir/admin.key.
	APIKey string
	// DataDir is the local server's data directory (for the admin.key fallback).
	DataDir string
	Stdin   io.Reader
	Stdout  io.Writer
	Stderr  io.Writer
}

// ExitError carries a process exit code through cobra.
type ExitError struct{ Code int }

func (e *ExitError) Error() string { return fmt.Sprintf("exit status %d", e.Code) }

// processExit is space's own exit for a process's exit event: the process's exit code
// (128+N when signal N ended it), with a line on stderr when the program did not
// choose its end: it could not be run, its timeout passed, or a signal killed it (as a
// shell does, not for SIGINT and SIGPIPE, which a user or a closed pipe sends).
func (a *app) processExit(exit *api.ExitEvent) error {
	switch {
	case exit.Error != "":
		fmt.Fprintf(a.env.Stderr, "space: %s\n", exit.Error)
	case exit.TimedOut:
		fmt.Fprintf(a.env.Stderr, "space: timed out: the process was killed (%s)\n", exit.Signal)
	case exit.Signal != "" && exit.Signal != "SIGINT" && exit.Signal != "SIGPIPE":
		fmt.Fprintf(a.env.Stderr, "space: the process was killed by %s\n", exit.Signal)
	}
	if code := client.ExitCode(exit); code != 0 {
		return &ExitError{Code: code}
	}
	return nil
}

// app holds the parsed global flags.
type app struct {
	env    *Env
	url    string
	apiKey string
	output string
}

// AddCommands adds the client commands and global flags to root.
func AddCommands(root *cobra.Command, env *Env) {
	a := &app{env: env}
	pf := root.PersistentFlags()
	pf.StringVar(&a.url, "url", env.URL, "space API URL (env SPACE_URL)")
	pf.StringVar(&a.apiKey, "api-key", env.APIKey, "API key (env SPACE_API_KEY; default: the local server's <data-dir>/admin.key)")
	pf.StringVarP(&a.output, "output", "o", "text", "output format: text or json")
	root.AddCommand(
		a.sandboxCmd(),
		a.execCmd(),
		a.opCmd(),
		a.apikeyCmd(),
		a.tenantCmd(),
		a.nodesCmd(),
		a.templateCmd(),
		a.benchCmd(),
		a.poolCmd(),
		a.portForwardCmd(),
		a.snapshotCmd(),
	)
	for _, c := range a.dataPlaneCmds() {
		root.AddCommand(c)
	}
}

// client returns an API client with the resolved key.
func (a *app) client() (*client.Client, error) {
	key := a.apiKey
	if key == "" {
		p := filepath.Join(a.env.DataDir, "admin.key")
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("no API key: set SPACE_API_KEY or --api-key (could not read %s: %v)", p, errors.Unwrap(err))
		}
		key = strings.TrimSpace(string(b))
	}
	return client.New(a.url, key), nil
}

func (a *app) json() bool { return a.output == "json" }

func (a *app) checkOutput() error {
	if a.output != "text" && a.output != "json" {
		return fmt.Errorf("--output must be text or json, not %q", a.output)
	}
	return nil
}

// connect checks --output and returns the API client: how every command that prints
// a result starts, so a bad --output fails before any request is made.
func (a *app) connect() (*client.Client, error) {
	if err := a.checkOutput(); err != nil {
		return nil, err
	}
	return a.client()
}

// printList prints items as a JSON array (empty, never null) or as a table under
// header with the cells row gives for each item.
func printList[T any](a *app, items []T, header []string, row func(T) []any) error {
	if a.json() {
		if items == nil {
			items = []T{}
		}
		return a.printJSON(items)
	}
	tw := a.table(header...)
	for _, it := range items {
		for i, cell := range row(it) {
			if i > 0 {
				fmt.Fprint(tw, "\t")
			}
			fmt.Fprint(tw, cell)
		}
		fmt.Fprintln(tw)
	}
	return tw.Flush()
}

// print writes v as indented JSON.
func (a *app) printJSON(v any) error {
	enc := json.NewEncoder(a.env.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

func (a *app) table(header ...string) *tabwriter.Writer {
	tw := tabwriter.NewWriter(a.env.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	return tw
}

func ago(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := time.Since(t).Round(time.Second)
	switch {
	case d < time.Minute:
		return d.String() + " ago"
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d.Hours()))
	default:
		return fmt.Sprintf("%dd ago", int(d.Hours()/24))
	}
}

// parseKV parses repeated KEY=VALUE flags.
func parseKV(flag string, vals []string) (map[string]string, error) {
	if len(vals) == 0 {
		return nil, nil
	}
	m := map[string]string{}
	for _, v := range vals {
		k, val, ok := strings.Cut(v, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--%s %q must look like KEY=VALUE", flag, v)
		}
		m[k] = val
	}
	return m, nil
}

func cmdContext(cmd *cobra.Command) context.Context {
	if ctx := cmd.Context(); ctx != nil {
		return ctx
	}
	return context.Background()
}

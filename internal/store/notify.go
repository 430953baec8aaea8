package store

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgxlisten"
)

// Notification channels.
const (
	// ChannelController wakes the controller (payload: sandbox id).
	ChannelController = "space_controller"
	// ChannelOperations announces operation changes (payload: operation id).
	ChannelOperations = "space_operations"
	// ChannelSandboxes announces sandbox changes: new sandboxes, new intent, observed
	// state (payload: sandbox id).
	ChannelSandboxes = "space_sandboxes"
	// ChannelTokens announces token revocations (payload: sandbox id).
	ChannelTokens = "space_tokens"
)

// NodeChannel is the channel that wakes one node (payload: sandbox id).
func NodeChannel(nodeID string) string { return "space_node_" + nodeID }

// Notify sends a notification when the transaction commits.
func (t *Tx) Notify(ctx context.Context, channel, payload string) error {
	_, err := t.tx.Exec(ctx, `SELECT pg_notify($1, $2)`, channel, payload)
	if err != nil {
		return fmt.Errorf("notify %s: %w", channel, err)
	}
	return nil
}

// Notify sends a notification now.
func (s *Store) Notify(ctx context.Context, channel, payload string) error {
	_, err := s.pool.Exec(ctx, `SELECT pg_notify($1, $2)`, channel, payload)
	if err != nil {
		return fmt.Errorf("notify %s: %w", channel, err)
	}
	return nil
}

// Listen delivers notifications on the given channels to fn until ctx ends, reconnecting
// after failures. fn must not block for long. After every (re)connect fn is called once
// per channel with an empty payload, so callers can resync state they may have missed.
func (s *Store) Listen(ctx context.Context, log *slog.Logger, fn func(channel, payload string), channels ...string) error {
	l := &pgxlisten.Listener{
		Connect: func(ctx context.Context) (*pgx.Conn, error) { return s.Connect(ctx) },
		LogError: func(ctx context.Context, err error) {
			if ctx.Err() == nil {
				log.Warn("listen", "err", err)
			}
		},
		ReconnectDelay: time.Second,
	}
	for _, ch := range channels {
		l.Handle(ch, listenHandler(fn))
	}
	return l.Listen(ctx)
}

type listenHandler func(channel, payload string)

func (h listenHandler) HandleNotification(_ context.Context, n *pgconn.Notification, _ *pgx.Conn) error {
	h(n.Channel, n.Payload)
	return nil
}

// HandleBacklog runs after (re)connecting: tell the caller to resync.
func (h listenHandler) HandleBacklog(_ context.Context, channel string, _ *pgx.Conn) error {
	h(channel, "")
	return nil
}

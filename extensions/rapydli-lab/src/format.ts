/** Small display helpers shared by the panel and the run view. */

/** Names tried, in order, for a run's "key metric". */
const KEY_METRICS = ['val_loss', 'loss', 'val_accuracy', 'accuracy', 'score'];

export function keyMetric(
  final: Record<string, number | null>
): [string, number] | null {
  for (const name of KEY_METRICS) {
    const value = final[name];
    if (typeof value === 'number') {
      return [name, value];
    }
  }
  for (const [name, value] of Object.entries(final)) {
    if (typeof value === 'number') {
      return [name, value];
    }
  }
  return null;
}

/** A number to read: 4 significant digits without trailing zeros (0.05, 0.1235), thousands
 * grouped (36,830), exponents only for the very large and very small (1.235e+7, 3.2e-5). */
export function formatNumber(value: unknown): string {
  if (typeof value !== 'number' || !isFinite(value)) {
    return value === null || value === undefined ? '' : String(value);
  }
  const size = Math.abs(value);
  if (size >= 1e6 || (size < 1e-3 && size > 0)) {
    return Number(value.toPrecision(4)).toExponential();
  }
  if (size >= 1000) {
    return Math.round(value).toLocaleString('en-US');
  }
  return Number.isInteger(value) ? String(value) : String(Number(value.toPrecision(4)));
}

export function formatDuration(seconds: number | null, started?: number): string {
  let s = seconds;
  if (s === null && started !== undefined) {
    s = Date.now() / 1000 - started;
  }
  if (s === null || s === undefined) {
    return '';
  }
  if (s < 60) {
    return `${s.toFixed(1)} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  }
  return `${(s / 3600).toFixed(1)} h`;
}

/** Create an element with a class, text and attributes. */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  props: { className?: string; text?: string; attrs?: Record<string, string> } = {},
  children: (Node | string)[] = []
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  if (props.className) {
    el.className = props.className;
  }
  if (props.text !== undefined) {
    el.textContent = props.text;
  }
  for (const [key, value] of Object.entries(props.attrs ?? {})) {
    el.setAttribute(key, value);
  }
  for (const child of children) {
    el.append(child);
  }
  return el;
}

/** The first 7 characters of an id (as git shows commits). */
export function shortId(id: string): string {
  return id.slice(0, 7);
}

/** "now", "5m ago", "3h ago", "2d ago", then a date: when something happened (short, for the panel). */
export function formatAgo(epochSeconds: number, now = Date.now() / 1000): string {
  const s = Math.max(0, now - epochSeconds);
  if (s < 45) {
    return 'now';
  }
  if (s < 3600) {
    return `${Math.max(1, Math.round(s / 60))}m ago`;
  }
  if (s < 86400) {
    return `${Math.round(s / 3600)}h ago`;
  }
  if (s < 14 * 86400) {
    return `${Math.round(s / 86400)}d ago`;
  }
  return new Date(epochSeconds * 1000).toLocaleDateString();
}

/** A compact duration for narrow columns: 850ms, 12.3s, 4m 05s, 2h 10m. */
export function formatShortDuration(seconds: number | null): string {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) {
    return '';
  }
  if (seconds < 1) {
    return `${Math.round(seconds * 1000)}ms`;
  }
  if (seconds < 60) {
    return `${seconds.toFixed(1)}s`;
  }
  if (seconds < 3600) {
    return `${Math.floor(seconds / 60)}m ${String(Math.round(seconds % 60)).padStart(2, '0')}s`;
  }
  return `${Math.floor(seconds / 3600)}h ${String(Math.round((seconds % 3600) / 60)).padStart(2, '0')}m`;
}

/** Symbol shown for a run status (the word is in its title and label). */
export const STATUS_ICON: Record<string, string> = {
  running: '●',
  finished: '✓',
  failed: '✗',
  interrupted: '◼',
  COMPLETE: '✓',
  PRUNED: '✂',
  FAIL: '✗'
};

/** The status element of a row: an icon with the word as its accessible name. */
export function statusBadge(status: string): HTMLElement {
  return h('span', {
    className: `rapydli-StatusIcon rapydli-status-${status}`,
    text: STATUS_ICON[status] ?? '?',
    attrs: { title: status, 'aria-label': status, 'data-status': status }
  });
}

/** A number in at most 6 characters (the panel's metric column): 0.4246, 0.0909, 12.34, 1.6e5, 3.2e-3. */
export function formatCompact(value: unknown): string {
  if (typeof value !== 'number' || !isFinite(value)) {
    return formatNumber(value);
  }
  const size = Math.abs(value);
  if (Number.isInteger(value) && size < 1e4) {
    return String(value);
  }
  if (size >= 1e4 || (size < 0.01 && size > 0)) {
    const [mantissa, exponent] = value.toExponential(1).split('e');
    return `${mantissa}e${Number(exponent)}`;
  }
  return String(Number(value.toPrecision(size < 0.1 ? 3 : 4)));
}

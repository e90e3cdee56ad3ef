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

export function formatNumber(value: unknown): string {
  if (typeof value !== 'number' || !isFinite(value)) {
    return value === null || value === undefined ? '' : String(value);
  }
  if (Number.isInteger(value)) {
    return String(value);
  }
  return Math.abs(value) >= 1000 || Math.abs(value) < 0.001
    ? value.toExponential(3)
    : value.toPrecision(4);
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
